"""The grid op (ops/grid/op.py, ops/grid/kernels.py): TTT's convs of q and k (with the keys' instance norm) and
MHLA's LePE as one kernel each, against the convolution written out tap by tap in float64. Kernels in Triton's
interpreter on the CPU, as in test_fused.py: values and gradients of x, the base, the filters and the bias, 3×3
and 5×5 filters, prefix tokens, masks, grids of more than one program's tokens, head dims 32/64/96, bf16, and the
fallbacks where Triton cannot build a kernel."""

from __future__ import annotations

import pytest
import torch

from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.grid import op as fused_grid
from vitconvert.attention.ops.grid.reference import grid_conv_reference
from vitconvert.attention.ops.ttt import op as fused_ttt

from . import helpers
from .helpers import rel_error

DEVICE = helpers.kernels_device()


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch):
    """The kernels on this machine's device; the torch convs in full float32, as the oracles are; float32 TTT
    modules on the kernels too (a GPU runs TTT's float32 inputs in torch: dispatch.TTT_DTYPES)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    with dispatch.kernels_on(DEVICE, ttt_dtypes=dispatch.DTYPES) as inner:
        yield inner


def op_inputs(d: int = 32, grid: tuple[int, int] = (5, 4), prefix: int = 1, size: int = 3, base: bool = False,
              bias: bool = True, masked: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0):
    """(x, base, weight, bias) of batch 2 and 2 heads laid out as a qkv projection's views (tokens-major), and a
    mask (a valid first token per image)."""
    g = torch.Generator().manual_seed(seed)
    N = prefix + grid[0] * grid[1]

    def tokens() -> torch.Tensor:
        return (torch.randn(2, N, 2, d, generator=g) * 1.5 + 0.3).to(DEVICE, dtype).transpose(1, 2).requires_grad_()

    x = tokens()
    weight = (torch.randn(2 * d, 1, size, size, generator=g) / size).to(DEVICE).requires_grad_()
    b = (torch.randn(2 * d, generator=g) * 0.1).to(DEVICE).requires_grad_() if bias else None
    mask = None
    if masked:
        mask = helpers.random_mask(2, N).to(DEVICE)
        mask[:, 0] = True
    return [x, tokens() if base else None, weight, b], mask


def against_float64(inputs, mask, grid, prefix, norm_eps, form=fused_grid.conv_on_grid):
    """(relative errors of ``form``'s y, then of each given input's gradient) against :func:`literal` in float64."""
    given = [t for t in inputs if t is not None]
    out = form(*inputs, mask, grid, prefix, norm_eps)
    copies = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    expected = grid_conv_reference(*copies, mask, grid, prefix, norm_eps)
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad(out, given, probe.to(out))
    want = torch.autograd.grad(expected, [t for t in copies if t is not None], probe)
    return [rel_error(out, expected), *(rel_error(a, b) for a, b in zip(got, want, strict=True))]


CASES = {  # (head dim, grid, prefix tokens, filter side, base, bias, masked, norm ε)
    "ttt-q": (32, (5, 4), 1, 3, False, True, False, None),
    "ttt-k": (32, (5, 4), 1, 3, False, True, False, 1.0),
    "ttt-k-masked": (32, (6, 7), 1, 3, False, True, True, 1.0),
    "ttt-q-masked-no-prefix": (64, (4, 4), 0, 3, False, True, True, None),
    "ttt-k-registers-d96": (96, (3, 5), 5, 3, False, False, False, 0.5),
    "lepe": (32, (5, 4), 1, 5, True, True, False, None),
    "lepe-masked": (64, (6, 7), 1, 5, True, False, True, None),
    "lepe-two-tiles": (32, (9, 8), 1, 5, True, True, True, None),  # 73 tokens: programs of 64
    "ttt-k-two-tiles": (32, (9, 8), 2, 3, False, True, True, 1.0),
}


@pytest.mark.parametrize("case", CASES)
def test_the_op_is_the_convolution_written_out_values_and_gradients(case):
    d, grid, prefix, size, base, bias, masked, norm_eps = CASES[case]
    inputs, mask = op_inputs(d, grid, prefix, size, base, bias, masked)
    errors = against_float64(inputs, mask, grid, prefix, norm_eps)
    assert max(errors) < 2e-6, errors


def test_tokens_that_do_not_form_the_grid_are_refused():
    inputs, _ = op_inputs(32, (5, 4), 1)
    with pytest.raises(ValueError, match="21 tokens do not form 1 prefix tokens and a 4x4 grid"):
        fused_grid.conv_on_grid(*inputs, None, (4, 4), 1)


def test_the_eager_form_is_the_convolution_written_out():
    """The op's torch form (its backward's fallback) against the literal one, every case in float64."""
    for d, grid, prefix, size, base, bias, masked, norm_eps in CASES.values():
        inputs, mask = op_inputs(d, grid, prefix, size, base, bias, masked)
        copies = [None if t is None else t.detach().double() for t in inputs]
        torch.testing.assert_close(fused_grid.grid_conv_eager(*copies, mask, *grid, prefix, norm_eps),
                                   grid_conv_reference(*copies, mask, grid, prefix, norm_eps), atol=1e-12, rtol=0)


@pytest.mark.parametrize("case", ["ttt-k-masked", "lepe-masked"])
def test_bf16_is_as_close_to_float64_as_the_torch_convs(case):
    """bf16 x and base: the kernel sums in float32 and rounds y once; the torch form under autocast rounds the
    normalised keys, the conv's output and the sum each. Gradients: the kernel rounds dx once (the base's is the
    output's gradient itself in both)."""
    d, grid, prefix, size, base, bias, masked, norm_eps = CASES[case]
    inputs, mask = op_inputs(d, grid, prefix, size, base, bias, masked, dtype=torch.bfloat16)
    errors = against_float64(inputs, mask, grid, prefix, norm_eps)

    def torch_form(x, base, weight, bias, mask, grid, prefix, norm_eps):  # as the modules ran it before the op
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            return fused_grid.grid_conv_eager(x, base, weight, bias, mask, *grid, prefix, norm_eps)

    torch_errors = against_float64(inputs, mask, grid, prefix, norm_eps, form=torch_form)
    assert all(e <= t for e, t in zip(errors, torch_errors, strict=True)) and max(errors) < 5e-3, (errors, torch_errors)


def test_the_key_statistics_hold_a_small_variance_beside_a_large_mean():
    """TTT's key statistics, a program a tile (the grid op's, merged by the last program) and a program a head (the
    step kernel's), within 1e-5 of float64 on float16 keys of mean 2048 and variance 16, where float32's
    Σx²/n − μ² is off by whole units (each path merges tiles' centred moments in token order)."""
    g = torch.Generator().manual_seed(0)
    d, side, eps = 16, 12, 1e-5
    N = 1 + side * side  # (tiles of 128 tokens, of 64 in the step kernel)
    k = (2048 + 4 * torch.randn(2, 2, N, d, generator=g)).to(DEVICE, torch.float16)
    mask = helpers.random_mask(2, N).to(DEVICE)

    def assert_exact(stats: torch.Tensor, valid: torch.Tensor, keys: torch.Tensor = k) -> None:
        m = valid[:, None, :, None].double()
        mean = (keys.double().cpu() * m).sum(2) / m.sum(2)
        var = ((keys.double().cpu() - mean[:, :, None]).square() * m).sum(2) / m.sum(2)
        assert rel_error(stats[0].cpu(), mean) < 1e-6 and rel_error(stats[1].cpu(), torch.rsqrt(var + eps)) < 1e-5

    assert_exact(fused_grid.statistics(k, None, eps), torch.ones(2, N, dtype=torch.bool))
    assert_exact(fused_grid.statistics(k, mask, eps), mask.cpu())
    weights = (0.1 * torch.randn(3, 2, d, d, generator=g)).to(DEVICE)
    filters = (torch.randn(2 * d, 1, 3, 3, generator=g) / 3).to(DEVICE)
    bias = torch.zeros(2 * d, device=DEVICE)
    with torch.no_grad():
        qv = torch.randn(1, 2, N, d, generator=g).to(DEVICE, torch.float16)
        _, stats = fused_ttt.run_ttt(qv, k[:1], qv, None, *weights, d ** -0.5, 1.0, filters, bias, filters, bias,
                                     eps, side, side, 1)
    assert_exact(stats, torch.ones(1, N, dtype=torch.bool), k[:1])


def test_the_op_keeps_its_input_and_the_filters_only():
    """No token-sized intermediate and not the base (LePE's: the attention's output, which the layer need not
    keep): x, the filters, the mask and the norm's (2, B, H, d) statistics."""
    d, grid, prefix, size, base, bias, masked, norm_eps = CASES["ttt-k-masked"]
    inputs, mask = op_inputs(d, grid, prefix, size, base, bias, masked)
    out = fused_grid.conv_on_grid(*inputs, mask, grid, prefix, norm_eps)
    saved = [tuple(t.shape) for t in out.grad_fn.saved_tensors if t is not None]
    assert saved == [tuple(inputs[0].shape), (2 * d, 1, 3, 3), tuple(mask.shape), (2, 2, 2, d)]
    inputs, mask = op_inputs(32, (5, 4), 1, 5, base=True)
    out = fused_grid.conv_on_grid(*inputs, mask, (5, 4), 1, None)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert [tuple(t.shape) for t in saved] == [tuple(inputs[0].shape), (64, 1, 5, 5), (0,)]


def test_an_expanded_output_gradient_gives_the_true_gradients():
    """``y.sum().backward()`` hands backward a gradient with every stride 0 (the kernels step through d by one)."""
    inputs, mask = op_inputs(32, (5, 4), 1, 3, masked=True)
    out = fused_grid.conv_on_grid(*inputs, mask, (5, 4), 1, 1.0)
    got = torch.autograd.grad(out.sum(), [inputs[0], inputs[2]])
    want = torch.autograd.grad(fused_grid.grid_conv_eager(*inputs, mask, 5, 4, 1, 1.0).sum(), [inputs[0], inputs[2]])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_op_passes_torch_library_checks():
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    for case in ("ttt-k-masked", "lepe"):
        d, grid, prefix, size, base, bias, masked, norm_eps = CASES[case]
        inputs, mask = op_inputs(d, grid, prefix, size, base, bias, masked)
        torch.library.opcheck(fused_grid.grid_conv, (*inputs, mask, *grid, prefix, norm_eps), test_utils=tests)


def grid_launches(variant: str, x: torch.Tensor, module: torch.nn.Module) -> list[str]:
    """The kernels one bf16-autocast training step of ``module`` launches, by name."""
    ran: list[str] = []

    def count(kernel, grid, *args, **kwargs):
        ran.append(dispatch.kernel_name(kernel))
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    with dispatch.launches_through(count, DEVICE), torch.autocast(DEVICE, dtype=torch.bfloat16):
        module(x).float().sum().backward()
    return ran


def split_heads() -> None:
    """Heads split over token ranges at 17 tokens (TTT's partial-sums path, where the grid op's kernels take the key
    statistics and the convs' backward)."""
    dispatch.current().split_round, dispatch.current().programs = 16, 64


@pytest.mark.parametrize("variant,form", [("ttt", "auto"), ("mhla", "blocked"), ("mhla", "pairwise")])
def test_the_variants_take_the_op(variant, form):
    """None: TTT where a program owns a head (its key norm, both convs and their backward are the step kernels';
    where heads split, the grid op's backward kernel: test_a_grid_kernel_the_gpu_cannot_build_leaves_the_convs_to_
    torch); MHLA in either form, whose kernels add LePE in their epilogues (the blocked form's read-out, its state
    backward taking LePE's gradient)."""
    dispatch.current().settings = dispatch.KernelSettings(form=form)
    module = helpers.make_module(variant, 1, (4, 4), dim=64, dtype=torch.float32).to(DEVICE)
    ran = grid_launches(variant, torch.randn(1, 17, 64, device=DEVICE), module)  # (one image: the interpreter is slow)
    assert (ran.count("grid_conv_fwd_kernel"), ran.count("grid_conv_bwd_kernel")) == (0, 0), ran
    assert ("pairwise_fwd_kernel" in ran) == (form == "pairwise"), ran
    assert ("readout_fwd_kernel" in ran) == (form == "blocked"), ran


@pytest.mark.parametrize("variant", ["ttt"])  # (MHLA's LePE runs in its attention kernels in either form)
@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_a_grid_kernel_the_gpu_cannot_build_leaves_the_convs_to_torch(variant, stage, monkeypatch):
    """Forward: the module's torch convs take over (TTT's step and MHLA's attention stay on their kernels).
    Backward (the forward ran on the grid kernel): that step's gradients from the op's eager form. One warning,
    and the grid op off for the process; the gradients those of the kernels' own. TTT's convs run inside its step
    op, whose backward runs the grid backward kernel where heads split over token ranges (in one program a head its
    own kernel takes it): that step's gradients come from the op's eager form, the grid op goes off and the step
    keeps its kernels (with the convs in torch from then on)."""
    if variant == "ttt":
        split_heads()
    module = helpers.make_module(variant, 1, (4, 4), dim=64, dtype=torch.float32).to(DEVICE)
    x = torch.randn(1, 17, 64, device=DEVICE, requires_grad=True)  # (one image: the interpreter runs a program per
    grad = torch.randn(1, 17, 64, device=DEVICE)                    # image, head and token range)
    want = torch.autograd.grad(module(x), [x, *module.parameters()], grad)
    dispatch.current().unavailable.clear()
    out = module(x) if stage == "backward" else None
    kernels = ("grid_conv_bwd_kernel",) if stage == "backward" else ("grid_conv_fwd_kernel", "grid_conv_bwd_kernel")
    helpers.cramped(kernels)
    with pytest.warns(RuntimeWarning, match="cannot run on this GPU .*for grid_conv"):
        out = module(x) if out is None else out
        got = torch.autograd.grad(out, [x, *module.parameters()], grad)
    attention = {"ttt": "ttt_step", "mhla": "pairwise_attention"}[variant]
    assert not dispatch.can_run(x, "grid_conv")
    assert dispatch.can_run(x, attention)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    with helpers.no_warnings():
        module(x)  # (no second warning)
