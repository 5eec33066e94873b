"""The fused kernels inside the tools users run them through: torch.library's checks, one compiled graph,
torch.export, kernels the GPU cannot build falling back to the eager form once, whole timm models, and the
memory a training forward keeps (in Triton's interpreter without a GPU, as test_fused.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_benchmark

from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.calls import _check_fake
from vitconvert.attention.ops.linear import op as fused

from . import helpers
from .fused_cases import (
    BACKWARD_KERNELS,
    DEVICE,
    FUSED_VARIANTS,
    kernels_here,  # noqa: F401  (an autouse fixture: the kernels on this device)
    make_module,
    padding_mask,
    qkv,
)


def test_custom_ops_pass_torch_library_checks():
    """torch.library.opcheck: schema, fake (meta) kernels and autograd registration agree with the real op —
    what torch.compile and torch.export rely on to treat each kernel as one op."""
    q, k, v = qkv(B=1, H=2, N=40, d=32)
    mask = padding_mask(1, 40)
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    from vitconvert.attention.blocks import extended_block_mix, segment_index

    index = segment_index((6, 6), (2, 3), 4, q.device)  # 4 prefix tokens + 36 on the grid: N = 40
    mixing = extended_block_mix(torch.rand(6, 6, device=DEVICE)).requires_grad_()
    torch.library.opcheck(fused.blocked_attention, (q, k, v, mask, index, mixing, fused.RELU_PLUS_EPS, 1e-6, 1e-6),
                          test_utils=tests)
    weights = [(1 + torch.rand(64, device=DEVICE)).requires_grad_() for _ in range(2)]  # MHLA's RMSNorm in the op
    lepe = ((torch.randn(64, 1, 3, 3, device=DEVICE) / 3).requires_grad_(),
            torch.randn(64, device=DEVICE).requires_grad_(), 6, 6, 4)  # (LePE: filters, bias, the 6×6 grid after 4)
    for table, mix, extra in ((index, mixing, lepe), (None, torch.ones(1, 1, device=DEVICE), ())):
        torch.library.opcheck(fused.blocked_attention, (q, k, v, mask, table, mix, fused.RELU_PLUS_EPS, 1e-6, 1e-6,
                                                        *weights, 1e-6, *extra), test_utils=tests)
    for inline in (False, True):
        torch.library.opcheck(fused.linear_attention, (q, k, v, mask, fused.RELU, 0.0, 1e-6, 0.125, inline),
                              test_utils=tests)


@pytest.mark.parametrize("form", ["pairwise", "blocked"])
def test_compiles_as_one_graph(form, monkeypatch):
    """torch.compile sees the kernels as custom ops: no graph break (fullgraph), same values as eager."""
    dispatch.current().settings = dispatch.KernelSettings(form=form)
    torch._dynamo.reset()
    module = make_module("mhla", 32, (4, 4), 1, blocks_per_side=2)
    x = torch.randn(1, 17, 64, device=DEVICE, requires_grad=True)  # (one image: a program per image and head)
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    out = compiled(x)
    torch.testing.assert_close(out, module(x), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_the_gpu_generation_check_compiles_as_one_graph(monkeypatch):
    """On CUDA, can_run asks the device's compute capability inside the module's forward; torch.compile takes it
    as a constant (dispatch.supported_generation) rather than tracing into torch.cuda: a query it cannot trace still
    compiles with fullgraph, to the kernels."""
    def untraceable(device=None):
        torch._dynamo.graph_break()
        return (9, 0)

    x = torch.randn(2, 17, 64, device=DEVICE, requires_grad=True)
    dispatch.current().generation_checked = (x.device.type,)
    monkeypatch.setattr(torch.cuda, "get_device_capability", untraceable)
    torch._dynamo.reset()
    module = make_module("elu", 32, (4, 4), 1)
    with helpers.no_warnings():  # (no warning from dynamo either)
        out = torch.compile(module, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(out, module(x), atol=1e-5, rtol=1e-5)


class ExportProbe(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1 if dispatch.exporting() else x - 1


def test_exporting_is_true_under_torch_export_alone():
    """Not under torch.compile: torch 2.11's dynamo (not 2.14's) folds torch.compiler.is_exporting() to True in
    every compile, which turned TTT's recomputation and the lean norms off in compiled training;
    dispatch.exporting reads the flag torch.export sets."""
    probe, x = ExportProbe(), torch.zeros(2)
    torch._dynamo.reset()
    assert probe(x).tolist() == [-1, -1]
    assert torch.compile(probe, backend="eager", fullgraph=True)(x).tolist() == [-1, -1]
    assert torch.export.export(probe, (x,)).module()(x).tolist() == [1, 1]




OPS = {"elu": ("linear_attention", "blocked_attention"), "inline": ("linear_attention", "blocked_attention"),
       "mhla": ("blocked_attention", "linear_attention")}  # (the variant's op, another)


def blocked_form(name: str, monkeypatch) -> None:
    """MHLA's kernels in their blocked form (states mixed and read out): at these sizes the call would take the
    pairwise one (tests/attention/test_fused_pairwise.py)."""
    if name == "mhla":
        dispatch.current().settings = dispatch.KernelSettings(form="blocked")


@pytest.mark.parametrize("name", ["elu", "inline", "mhla"])
def test_a_kernel_the_gpu_cannot_build_falls_back_to_the_eager_form_once(name, monkeypatch):
    blocked_form(name, monkeypatch)
    module = make_module(name, 32, (4, 4), 1, **({"blocks_per_side": 2} if name == "mhla" else {}))
    x = torch.randn(1, 17, 64, device=DEVICE)  # (one image, as above)
    expected = module(x)
    dispatch.current().unavailable.clear()
    helpers.cramped(("attention_fwd_kernel", "state_fwd_kernel", "readout_fwd_kernel"))
    with pytest.warns(RuntimeWarning, match="cannot run on this GPU .*OutOfResources.*VITCONVERT_FUSED=0"):
        out = module(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    op, other = OPS[name]
    assert not dispatch.can_run(x, op) and dispatch.can_run(x, other)  # that op's off: no second warning or try

    with helpers.no_warnings():
        module(x)




@pytest.mark.parametrize("name", ["elu", "inline", "mhla"])
def test_a_backward_kernel_the_gpu_cannot_build_falls_back_to_the_eager_gradients(name, monkeypatch):
    """The forward ran on the kernels, backward cannot build one: a warning, that op's kernels off for the process,
    and this step's gradients (inputs and parameters, MHLA's W included) from the ops' eager forms."""
    blocked_form(name, monkeypatch)
    module = make_module(name, 32, (4, 4), 1, **({"blocks_per_side": 2} if name == "mhla" else {}))
    x = torch.randn(1, 17, 64, device=DEVICE, requires_grad=True)  # (one image, as above)
    grad = torch.randn(1, 17, 64, device=DEVICE)
    want = torch.autograd.grad(module(x), [x, *module.parameters()], grad)
    dispatch.current().unavailable.clear()
    out = module(x)  # forward on the kernels
    helpers.cramped(BACKWARD_KERNELS)
    with pytest.warns(RuntimeWarning, match="cannot run on this GPU .*OutOfResources.*VITCONVERT_FUSED=0"):
        got = torch.autograd.grad(out, [x, *module.parameters()], grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    op, other = OPS[name]
    assert not dispatch.can_run(x, op) and dispatch.can_run(x, other)  # that op's next step runs eager, unwarned


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_the_eager_forms_of_the_ops_compute_what_the_kernels_compute(masked):
    """fused_eager (the backward fallback) against the kernels: states and read-out over MHLA's segment table
    with its −1 pads and the prefix segment, and the one-segment kernel attention."""
    from vitconvert.attention.blocks import segment_index
    from vitconvert.attention.ops.linear import eager as fused_eager

    q, k, v = (t.detach() for t in qkv(N=1 + 36))
    key_valid = padding_mask(2, 37) if masked else None
    index = segment_index((6, 6), (2, 3), 1, q.device)  # uneven blocks: the table pads with −1
    S, z, zv = fused.segment_states(k, v, key_valid, index, fused.RELU_PLUS_EPS, 1e-3, True)
    S0, z0, zv0 = fused_eager.state(k, v, key_valid, index, fused.RELU_PLUS_EPS, 1e-3)
    for got, want in ((S, S0), (z, z0), (zv, zv0)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    o = fused.run_readout(q, S, z, index, fused.RELU_PLUS_EPS, 1e-3, 1e-6, True)
    torch.testing.assert_close(o, fused_eager.readout(q, S, z, index, fused.RELU_PLUS_EPS, 1e-3, 1e-6, True),
                               atol=1e-5, rtol=1e-5)
    for feature, inline in ((fused.ELU_PLUS_ONE, False), (fused.IDENTITY, True)):
        args = (key_valid, feature, 0.0, 1e-6 if not inline else 0.0, 0.5 if inline else 1.0, inline)
        torch.testing.assert_close(fused.linear_attention(q, k, v, *args), fused._attention_eager(q, k, v, *args),
                                   atol=1e-5, rtol=1e-5)


FAMILIES = ("vit", "eva02", "dinov2", "deit_distilled")
# MHLA's kernels take a family's prefix tokens as a count (a segment of their own): registers (DINOv2's five) stand
# for the class and distillation tokens there; EVA-02 keeps its own path (rope, q and v biases: no fused LayerNorm)
MODEL_CASES = [(family, name) for name in FUSED_VARIANTS for family in FAMILIES
               if name != "mhla" or family in ("eva02", "dinov2")]


@pytest.mark.parametrize("family,name", MODEL_CASES, ids=[f"{name}-{family}" for family, name in MODEL_CASES])
def test_whole_timm_models_on_the_kernels_match_their_eager_form(family, name, monkeypatch):
    """Converted timm models as users run them (qkv layouts, rope, registers, distillation tokens), one
    training step: logits and every gradient of the fused model equal the eager model's."""
    from helpers import image_batch, tiny_model

    import vitconvert
    calls = []

    def count(kernel, grid, *args, **kwargs):  # the forward's launches of the attention ops
        calls.append(dispatch.kernel_name(kernel))
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    source = tiny_model(family)
    student, _ = vitconvert.convert(source, name)
    student = student.to(DEVICE).train()
    x = image_batch(source, batch=1).to(DEVICE)  # (the interpreter runs a program per image and head)
    results = []
    for fused_on in (True, False):
        for module in student.modules():
            if hasattr(module, "fused_kernels"):
                module.fused_kernels = fused_on
        student.zero_grad()
        with dispatch.kernels_on(launcher=count):
            logits = student(x)
        logits.square().sum().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in student.named_parameters()
                                          if p.grad is not None}))
        if fused_on:
            first = {"attention_fwd_kernel", "state_fwd_kernel", "pairwise_fwd_kernel"}  # (each op's first)
            assert sum(name in first for name in calls) == 2, calls  # both blocks ran on the kernels
            launched = len(calls)
    assert len(calls) == launched  # and none when switched off
    (fused_logits, fused_grads), (eager_logits, eager_grads) = results
    torch.testing.assert_close(fused_logits, eager_logits, atol=1e-5, rtol=1e-4)
    assert fused_grads.keys() == eager_grads.keys()
    for n in eager_grads:
        torch.testing.assert_close(fused_grads[n], eager_grads[n], atol=1e-5, rtol=1e-3, msg=n)


def saved_mib(model: torch.nn.Module, images: torch.Tensor) -> float:
    """benchmarks/saved_memory.py's measure (what autograd keeps from one bf16-autocast training forward, MiB)."""

    return load_benchmark("saved_memory").saved_mib(model, images)


# a training step's memory against softmax's (SDPA keeps q, k, v, o and the log-sum-exp), measured as what
# autograd saves: the same on any device. At 32 px with 16-token ranges each head splits in two as at 224 px (the
# state/read-out kernels, TTT's split sums), one block of width 96: weights weigh more against the activations than
# at 224 px, so MHLA's ratio is lower there. ELU/ReLU/InLine keep exactly softmax's. MHLA also its input LayerNorm's
# input and the normalised q and k (1.03× with the LayerNorm and the qkv projection as two ops; 1.53× with its
# kernels off); fused, it keeps the float32 qkv weight instead of a bf16 copy, hence below 1. TTT keeps q, k, v and
# the keys' float32 statistics (0.3% here) and recomputes its closed-form step in backward (1.52× when autograd kept
# the step's intermediates). An extra q-sized copy in the linear-attention op reads 1.015×.
SAVED_VS_SOFTMAX = {"elu": 1.0, "relu": 1.0, "inline": 1.0, "mhla": 0.87, "ttt": 1.0}


def test_a_training_forward_keeps_no_more_than_its_budget_against_softmax():
    import timm

    import vitconvert

    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=96,
                               num_heads=3, depth=1, num_classes=10).to(DEVICE)
    images = torch.randn(2, 3, 32, 32, device=DEVICE)
    dispatch.current().split_round = 16  # (17 tokens: two ranges a head)
    softmax = saved_mib(source, images)
    ratios = {name: saved_mib(vitconvert.convert(source, name)[0], images) / softmax for name in SAVED_VS_SOFTMAX}
    over = {name: round(r, 3) for name, r in ratios.items() if r > SAVED_VS_SOFTMAX[name] + 0.005}
    assert not over, (over, ratios)


def test_a_fake_is_held_to_the_strides_that_place_elements():
    """The fake check (gpu_check's parity section) ignores the stride of a dimension of size 1, which places nothing
    (TTT's step at one head and one token: (64, 128, 128, 1) against its fake's (64, 64, 64, 1)), and still
    catches a real layout difference."""
    x = torch.randn(2, 1, 1, 4)
    same, other = [], []
    _check_fake(torch.ops.aten.clone.default, (x,), torch.empty(2, 1, 1, 4).as_strided(x.shape, (4, 8, 8, 1)),
                      same)
    y = torch.randn(2, 4)
    _check_fake(torch.ops.aten.clone.default, (y,), torch.empty(4, 2).t(), other)
    assert same == [] and len(other) == 1 and other[0][1][2] != other[0][2][2]
