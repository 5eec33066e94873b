"""Every variant is a timm attention layer: built from timm's arguments into an initialised module, usable as
``attn_layer=`` of timm's VisionTransformer (a class or a registered name), a from-scratch linear ViT that trains."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
from timm.layers import Attention
from torch import nn

import vitconvert
from vitconvert.attention import VARIANTS, LinearAttention
from vitconvert.attention.mhla import MHLAttention, distance_weights
from vitconvert.attention.ttt import TTTAttention
from vitconvert.errors import BadValue

TIMM_ARGS = dict(qkv_bias=True, qk_norm=True, proj_bias=True, attn_drop=0.0, proj_drop=0.1, norm_layer=nn.LayerNorm)
TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=4)


def shapes(module: nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in module.state_dict().items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_built_like_timm_attention_has_its_layout_and_works(variant):
    torch.manual_seed(0)
    attn = VARIANTS[variant](32, num_heads=2, **TIMM_ARGS)
    softmax = Attention(32, num_heads=2, **TIMM_ARGS)
    assert shapes(attn).items() >= shapes(softmax).items()  # timm's names and shapes, plus the variant's extras
    assert isinstance(attn.q_norm, nn.LayerNorm) and attn.proj_drop.p == 0.1
    assert all(torch.isfinite(p).all() for p in attn.state_dict().values())
    x = torch.randn(2, 17, 32)
    out = attn(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in attn.parameters())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_from_softmax_and_direct_construction_have_the_same_state_layout(variant):
    """A from-scratch model and a converted one are interchangeable (same names, shapes and order)."""
    src = Attention(32, num_heads=2, qkv_bias=True)
    direct = VARIANTS[variant](32, num_heads=2, qkv_bias=True, grid_size=(4, 4))
    converted = VARIANTS[variant].from_softmax(src, grid_size=(4, 4))
    assert list(shapes(direct).items()) == list(shapes(converted).items())
    assert torch.equal(converted.qkv.weight, src.qkv.weight) and converted.qkv.weight is not src.qkv.weight


def test_mhla_built_directly_has_its_distance_init_not_garbage():
    attn = MHLAttention(32, num_heads=2, grid_size=(4, 4), blocks_per_side=2)
    assert attn.block_counts == (2, 2)
    torch.testing.assert_close(attn.block_mix.detach(), distance_weights((2, 2)).float())
    assert torch.allclose(attn.block_mix.sum(dim=0), torch.ones(4))


@pytest.mark.parametrize("way", ["direct", "from_softmax"])
def test_extras_are_initialised_exactly_once(monkeypatch, way):
    calls = []
    original = TTTAttention.reset_extra_parameters
    monkeypatch.setattr(TTTAttention, "reset_extra_parameters", lambda self: (calls.append(1), original(self)))
    if way == "direct":
        attn = TTTAttention(32, num_heads=2)
    else:
        attn = TTTAttention.from_softmax(Attention(32, num_heads=2))
    assert len(calls) == 1
    assert 0.01 < attn.fast_w1.std().item() < 0.03  # trunc-normal std 0.02, as the reference


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_from_softmax_extras_do_not_depend_on_construction_garbage(variant):
    """from_softmax builds on the meta device and then initialises: the same seed gives the same module."""
    src = Attention(32, num_heads=2, qkv_bias=True)
    options = {"local_residual": True} if variant == "inline" else {}
    states = []
    for _ in range(2):
        torch.manual_seed(3)
        states.append(VARIANTS[variant].from_softmax(src, grid_size=(4, 4), **options).state_dict())
    assert all(torch.isfinite(v).all() and torch.equal(v, states[1][k]) for k, v in states[0].items())


def test_options_are_keyword_arguments_checked_by_their_declaration():
    assert MHLAttention.default_options["transform"] == "cos" and TTTAttention.default_options["inner_lr"] is None
    with pytest.raises(TypeError, match="window"):
        MHLAttention(32, num_heads=2, window=4)
    with pytest.raises(BadValue, match="transform") as bad:
        MHLAttention(32, num_heads=2, transform="gaussian")
    assert bad.value.name == "transform"  # the constructor's own argument
    with pytest.raises(ValueError, match="attn_drop"):
        VARIANTS["elu"](32, num_heads=2, attn_drop=0.1)  # no attention weights to drop
    with pytest.raises(BadValue, match="unknown option") as bad:
        TTTAttention.from_softmax(Attention(32, num_heads=2), chunk_size=4)
    assert bad.value.name == "option"  # one of from_softmax's **options (convert's options, the CLI's --option)


def train_losses(model: nn.Module, steps: int = 6) -> list[float]:
    """Cross-entropy over ``steps`` AdamW steps on one fixed batch of 16 images."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model.train()(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_timm_vit_from_scratch_with_attn_layer_trains(variant):
    """timm.create_model(..., attn_layer=<class>) and attn_layer="vitconvert_<variant>" give the same linear ViT,
    whose loss falls over a few optimizer steps. TTT pools by average: see the next test for its class token."""
    cls = VARIANTS[variant]
    pool = {"global_pool": "avg"} if variant == "ttt" else {}
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", attn_layer=cls, **TINY_VIT, **pool)
    torch.manual_seed(0)
    by_name = timm.create_model("vit_small_patch16_224", attn_layer=f"vitconvert_{variant}", **TINY_VIT, **pool)
    assert all(type(b.attn) is cls for b in model.blocks)
    assert all(torch.equal(v, by_name.state_dict()[k]) for k, v in model.state_dict().items())
    losses = train_losses(model)
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("inner_lr,learns", [(None, True), (1.0, False)])
def test_ttt_class_token_learns_only_with_a_step_that_mixes(inner_lr, learns):
    """TTT's fast weights start at std 0.02, where the inner model's output is cubic in small weights: with the
    reference's step size 1.0 the step mixes ~1e-6 of v into each token, the class token sees no patch and the
    loss stays at the label prior (why converted TTT students stayed at chance in transfer, docs/results.md).
    The default step size (auto_inner_lr) mixes enough for the class token to learn in 30 steps."""
    torch.manual_seed(0)
    layer = TTTAttention.configure(inner_lr=inner_lr)
    model = timm.create_model("vit_small_patch16_224", attn_layer=layer, **TINY_VIT)
    losses = train_losses(model, steps=30)
    assert (losses[-1] < 0.9 * losses[0]) == learns, losses


def test_timm_vit_init_keeps_the_variants_own_init():
    """timm's ViT init re-initialises Linear layers; the extras keep their method's init (init_weights hook)."""
    layer = MHLAttention.configure(grid_size=(4, 4), blocks_per_side=2)
    model = timm.create_model("vit_small_patch16_224", attn_layer=layer, **TINY_VIT)
    attn = model.blocks[0].attn
    assert attn.block_counts == (2, 2) and attn.options["blocks_per_side"] == 2
    torch.testing.assert_close(attn.block_mix.detach(), distance_weights((2, 2)).float())
    assert abs(attn.qkv.weight.std().item() - 0.02) < 0.005  # timm's trunc-normal ViT init of the projections


def test_configure_rejects_unknown_arguments_and_bad_values():
    with pytest.raises(ValueError, match="window"):
        MHLAttention.configure(window=3)
    with pytest.raises(BadValue, match="mhla's exp_sigma must be positive, got 0"):
        MHLAttention.configure(exp_sigma=0)
    assert MHLAttention.configure(transform="exp").default_options["transform"] == "exp"


def test_from_scratch_linear_vit_saves_as_a_folder_timm_and_vitconvert_load(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", attn_layer=VARIANTS["inline"], **TINY_VIT).eval()
    vitconvert.save(model, tmp_path / "m")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(vitconvert.load(tmp_path / "m")(x), expected)
        assert torch.equal(timm.create_model(f"local-dir:{tmp_path / 'm'}", pretrained=True).eval()(x), expected)
    assert isinstance(vitconvert.load(tmp_path / "m").blocks[1].attn, LinearAttention)


@pytest.mark.parametrize("variant", ["elu", "relu", "inline", "mhla", "ttt"])
def test_a_traced_folder_warns_no_more_than_its_softmax_source(variant, tmp_path):
    """torch.jit.trace of a saved student: only the TracerWarnings timm's own softmax model gives (a trace is fixed
    to its input's size), none from the attention's shape branches (issue 39: 12-76 per folder), and the trace
    taken at batch 2 is right at batch 1."""
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                               num_heads=2, depth=2, num_classes=3).eval()
    student, _ = vitconvert.convert(source, variant)
    vitconvert.save(student, tmp_path / "m")
    loaded = vitconvert.load(tmp_path / "m").eval()
    x = torch.randn(2, 3, 32, 32)

    def tracer_warnings(model):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            traced = torch.jit.trace(model, x, check_trace=False)
        return traced, [w for w in seen if issubclass(w.category, torch.jit.TracerWarning)]

    _, softmax_warnings = tracer_warnings(source)
    traced, ours = tracer_warnings(loaded)
    assert len(ours) <= len(softmax_warnings), [f"{w.filename}:{w.lineno} {w.message}" for w in ours]
    assert not [w for w in ours if "vitconvert" in w.filename]
    torch.testing.assert_close(traced(x[:1]), loaded(x[:1]), atol=1e-5, rtol=1e-4)


def test_a_configured_class_is_the_variant_with_defaults_a_keyword_still_overrides():
    """configure() returns an ordinary subclass named as the variant, whose defaults a keyword at build time
    beats (timm's Block passes its own keywords; a caller may pass an option too)."""
    layer = MHLAttention.configure(grid_size=(4, 4), blocks_per_side=2)
    assert issubclass(layer, MHLAttention) and layer.__name__ == "MHLAttention"
    assert layer(64, num_heads=2).options["blocks_per_side"] == 2
    assert layer(64, num_heads=2, blocks_per_side=1).options["blocks_per_side"] == 1
