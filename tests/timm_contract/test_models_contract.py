"""timm's model contract, on converted models: each check of timm's own tests/test_models.py that a softmax
source passes, its converted twins pass too.

The checks mirror pytorch-image-models' tests/test_models.py (Apache-2.0, huggingface/pytorch-image-models:
test_model_forward, _backward, _default_cfgs (forward_features, reset_classifier), _forward_intermediates,
_forward_features (features_only), _forward_torchscript, _forward_fx / _backward_fx, grad checkpointing,
dynamic image size and set_input_size), rewritten for tiny models; every model is created the way a user
creates it: ``timm.create_model(name)`` for the source, ``timm.create_model("vitconvert_<variant>",
architecture=name)`` for the converted one (the entrypoint that ``import vitconvert`` registers), same seed.

A check the source fails (e.g. NaFlexViT has no ``set_input_size``) is skipped for its variants with the
source's own error; every other check must pass, with outputs equal to eager ones where a check compiles or
traces. ``python -m pytest tests/timm_contract -q -rs`` prints the counts.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import pytest
import timm
import torch
from helpers import FAMILIES as HELPER_FAMILIES
from timm.layers import set_scriptable
from timm.models._features_fx import create_feature_extractor, get_graph_node_names

import vitconvert


def deeper(family: str) -> tuple[str, dict]:
    """A tiny family config of tests/helpers.py at depth 3: timm's features_only default takes the last 3 blocks."""
    name, tiny = HELPER_FAMILIES[family]
    return name, {**tiny, "depth": 3}


# family -> (timm name, tiny arguments): DeiT, DINOv2 with registers, EVA-02, two rope ViTs, BEiT, NaFlexViT
FAMILIES: dict[str, tuple[str, dict]] = {
    "deit": ("deit_tiny_patch16_224", deeper("vit")[1]),
    "dinov2_reg": deeper("dinov2"),
    "eva02": deeper("eva02"),
    "rope_vit": ("vit_small_patch16_rope_224", deeper("vit")[1]),
    "rope_reg_gap": ("vit_base_patch16_rope_reg1_gap_256", deeper("vit")[1]),
    "beit": deeper("beit"),
    "naflex": deeper("naflex"),
}
MODELS = ["softmax", *vitconvert.VARIANTS]
# The compiling checks (script, trace, fx) build one block: each block is the same module, so a model of one block
# reaches every path a deeper one does, at about half the cost; depth 3 stays where the depth is the check's point.
ONE_BLOCK = {"depth": 1}



def create(family: str, model: str, **kwargs) -> torch.nn.Module:
    name, tiny = FAMILIES[family]
    torch.manual_seed(0)
    if model == "softmax":
        return timm.create_model(name, pretrained=False, **{**tiny, **kwargs})
    return timm.create_model(f"vitconvert_{model}", architecture=name, pretrained=False, **{**tiny, **kwargs})


@functools.cache  # (a model built to read it: 75 ms, a dozen times per family and model otherwise)
def input_size(family: str) -> tuple[int, int, int]:
    embed = getattr(create(family, "softmax"), "patch_embed", None)
    return (3, *embed.img_size) if embed is not None and getattr(embed, "img_size", None) else (3, 32, 32)


def images(family: str, batch: int = 1, size: tuple[int, int, int] | None = None) -> torch.Tensor:
    return torch.randn(batch, *(size or input_size(family)), generator=torch.Generator().manual_seed(1))


# -- the checks: each raises when the model breaks the contract ---------------------------------------------
def forward(family: str, model: str) -> None:
    net = create(family, model).eval()
    out = net(images(family))
    assert out.shape[0] == 1 and not out.isnan().any()


def backward(family: str, model: str) -> None:
    net = create(family, model, num_classes=42).train()
    out = net(images(family, batch=2))
    out.mean().backward()
    missing = [n for n, p in net.named_parameters() if p.grad is None]
    assert out.shape[-1] == 42 and not missing, f"no gradient for {missing[:3]}"


def forward_features(family: str, model: str) -> None:
    net = create(family, model).eval()
    x = images(family)
    features = net.forward_features(x)
    assert features.shape[-1] == net.num_features
    net.reset_classifier(0)
    pooled = net(x)
    assert pooled.shape == (1, net.num_features)


def forward_intermediates(family: str, model: str) -> None:
    net = create(family, model).eval()
    x = images(family)
    final, intermediates = net.forward_intermediates(x)
    torch.testing.assert_close(final, net.forward_features(x))
    only = net.forward_intermediates(x, indices=2, intermediates_only=True)
    assert len(intermediates) == len(net.blocks) and len(only) == 2
    for a, b in zip(only, intermediates[-2:], strict=True):
        torch.testing.assert_close(a, b)


def features_only(family: str, model: str) -> None:
    net = create(family, model, features_only=True).eval()
    full = create(family, model).eval()
    x = images(family)
    maps = net(x)
    assert len(maps) == len(net.feature_info.channels())
    for got, want, channels in zip(maps, full.forward_intermediates(x, indices=3, intermediates_only=True),
                                   net.feature_info.channels(), strict=True):
        assert got.shape[1] == channels
        torch.testing.assert_close(got, want)


def torchscript_script(family: str, model: str) -> None:
    with set_scriptable(True):
        net = create(family, model, **ONE_BLOCK).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(net)
    x = images(family)
    torch.testing.assert_close(scripted(x), net(x))


def torchscript_trace(family: str, model: str) -> None:
    net = create(family, model, **ONE_BLOCK).eval()
    x = images(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(net, x)
    torch.testing.assert_close(traced(images(family, batch=1)), net(images(family, batch=1)))


def fx_forward_backward(family: str, model: str) -> None:
    """One extractor, traced in both modes (torchvision's DualGraphModule, as timm's own fx tests build it): its
    eval graph gives the eager output, its train graph backpropagates to the parameters."""
    net = create(family, model, **ONE_BLOCK).eval()
    train_nodes, eval_nodes = get_graph_node_names(net)
    assert train_nodes[-1] == eval_nodes[-1], (train_nodes[-1], eval_nodes[-1])  # the head, in either mode
    extractor = create_feature_extractor(net, return_nodes=[eval_nodes[-1]])
    x = images(family)
    torch.testing.assert_close(next(iter(extractor(x).values())), net(x))
    extractor.train()
    next(iter(extractor(images(family, batch=2)).values())).mean().backward()
    assert any(p.grad is not None for p in extractor.parameters())


def grad_checkpointing(family: str, model: str) -> None:
    net = create(family, model).train()
    plain = create(family, model).train()
    x = images(family, batch=2)
    torch.manual_seed(0)
    want = plain(x)
    net.set_grad_checkpointing(True)
    torch.manual_seed(0)
    got = net(x)
    got.mean().backward()
    torch.testing.assert_close(got, want)
    assert all(p.grad is not None for p in net.parameters() if p.requires_grad)


def dynamic_img_size(family: str, model: str) -> None:
    net = create(family, model, dynamic_img_size=True).eval()
    _, h, w = input_size(family)
    patch = net.patch_embed.patch_size[0]
    out = net(images(family, size=(3, h + 2 * patch, w + 2 * patch)))  # a larger square grid
    assert out.shape[0] == 1 and not out.isnan().any()


def set_input_size(family: str, model: str) -> None:
    net = create(family, model).eval()
    _, h, w = input_size(family)
    net.set_input_size(img_size=(2 * h, 2 * w))
    out = net(images(family, size=(3, 2 * h, 2 * w)))
    assert out.shape[0] == 1 and not out.isnan().any()


CHECKS: dict[str, Callable[[str, str], None]] = {f.__name__: f for f in (
    forward, backward, forward_features, forward_intermediates, features_only, torchscript_script,
    torchscript_trace, fx_forward_backward, grad_checkpointing, dynamic_img_size, set_input_size)}


@functools.cache
def source_result(family: str, check: str) -> str:
    """'' when the softmax source passes ``check``, else its error (then the variants are not held to it)."""
    try:
        CHECKS[check](family, "softmax")
    except Exception as e:  # noqa: BLE001 - any failure of the source's own contract
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return ""


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_timm_model_contract(family, model, check):
    failed = source_result(family, check)  # (the softmax row's check: it ran there, once)
    if failed:
        pytest.skip(f"the softmax source fails this check too ({failed})")
    if model != "softmax":
        CHECKS[check](family, model)


def test_the_sources_pass_what_timm_promises():
    """The skips above are the sources' own gaps, not ours: list them, so a timm upgrade that fixes or breaks
    one shows here."""
    gaps = {(f, c) for f in FAMILIES for c in CHECKS if source_result(f, c)}
    assert gaps == {("beit", "dynamic_img_size"), ("naflex", "torchscript_script"),
                    ("naflex", "dynamic_img_size"), ("naflex", "set_input_size")}, gaps


@pytest.mark.parametrize(("variant", "options"), [
    ("elu", {}), ("relu", {}), ("ttt", {}), ("inline", {"local_residual": True}),
    ("mhla", {"denominator": "official", "blocks_per_side": 3}),  # 3×3 blocks on a 4×4 grid: the gathered layout
    ("mhla", {"lepe_kernel": 0, "qk_rmsnorm": False, "input_norm": False}),
])
def test_scripted_attention_equals_eager(variant: str, options: dict) -> None:
    """The option paths the models above do not take, scripted alone: with and without a key-padding mask, on
    the grid and off it (no grid: the grid-free forms)."""
    from timm.layers import Attention

    torch.manual_seed(0)
    module = vitconvert.VARIANTS[variant].from_softmax(Attention(dim=32, num_heads=2, qkv_bias=True),
                                                       num_prefix_tokens=1, grid_size=(4, 4), **options).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scripted = torch.jit.script(module)
    mask = torch.ones(2, 1, 17, 17, dtype=torch.bool)
    mask[1, ..., 13:] = False  # the second item's last four tokens are padding
    with torch.no_grad(), torch.jit.optimized_execution(False):
        for tokens, attn_mask in ((17, None), (17, mask), (20, None)):
            x = torch.randn(2, tokens, 32, generator=torch.Generator().manual_seed(tokens))
            torch.testing.assert_close(scripted(x, attn_mask=attn_mask), module(x, attn_mask=attn_mask),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["rope_vit", "dinov2_reg"])
def test_converting_a_features_only_model_sees_through_timms_wrapper(family):
    """A user's timm.create_model(..., features_only=True) converted directly: prefix tokens and grid are the
    ViT's inside the wrapper (a rope ViT failed with 17 vs 16 tokens; MHLA silently lost its grid)."""
    wrapped = create(family, "softmax", features_only=True).eval()
    student, _ = vitconvert.convert(wrapped, "mhla", options={"blocks_per_side": 2}, attn_init="copy")
    attn = next(m for m in student.modules() if isinstance(m, vitconvert.attention.LinearAttention))
    plain, _ = vitconvert.convert(create(family, "softmax").eval(), "mhla", options={"blocks_per_side": 2},
                                  attn_init="copy")
    assert attn.num_prefix_tokens == plain.blocks[0].attn.num_prefix_tokens and attn.grid_size is not None
    x = images(family)
    for got, want in zip(student(x), plain.forward_intermediates(x, indices=3, intermediates_only=True),
                         strict=True):
        torch.testing.assert_close(got, want)
