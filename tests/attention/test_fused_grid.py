"""The grid kernels that run on their own (ops/grid/op.py, ops/grid/kernels.py), TTT's key statistics and its convs'
backward where heads split over token ranges, against the convolution written out tap by tap in float64 (3×3
filters, prefix tokens, masks, grids of more than one program's tokens, head dims 32/64/96); the conv's torch form
(LePE's and TTT's eager forms) against it too; which variants launch the kernels, and the fallback where Triton
cannot build them. Kernels in Triton's interpreter on the CPU, as in test_fused.py."""

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


CASES = {  # (head dim, grid, prefix tokens, filter side, base, bias, masked, norm ε): TTT's q and k, MHLA's LePE
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


@pytest.mark.parametrize("case", ["ttt-q-masked-no-prefix", "ttt-k-two-tiles", "ttt-k-registers-d96"])
def test_the_convs_backward_is_the_convolution_written_out(case):
    """dx, dw and dbias of TTT's residual conv y = x̂ + bias + conv(x̂·m) from the grid kernel (through the keys'
    instance norm two launches, on the statistics of the grid's reading pass), as TTT's step calls it where heads
    split, against float64 autograd of the conv written out."""
    d, grid, prefix, size, _, bias, masked, norm_eps = CASES[case]
    (x, _, weight, b), mask = op_inputs(d, grid, prefix, size, False, bias, masked)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    x = x.detach()
    stats = fused_grid.statistics(x, mask, norm_eps) if norm_eps is not None else x.new_empty((0,))
    got = fused_grid.run_grid_conv_backward(x, weight, mask, stats, dy, *grid, prefix, norm_eps is not None)
    copies = [None if t is None else t.detach().double().requires_grad_() for t in (x, weight, b)]
    expected = grid_conv_reference(copies[0], None, copies[1], copies[2], mask, grid, prefix, norm_eps)
    want = torch.autograd.grad(expected, [t for t in copies if t is not None], dy.double())
    errors = [rel_error(mine, exact) for mine, exact in zip(got, want, strict=False)]
    assert len(errors) == len(want) and max(errors) < 2e-6, errors


def test_the_eager_form_is_the_convolution_written_out():
    """The conv's torch form (TTT's and LePE's eager forms, the backward kernel's fallback) against the literal
    one, every case in float64."""
    for d, grid, prefix, size, base, bias, masked, norm_eps in CASES.values():
        inputs, mask = op_inputs(d, grid, prefix, size, base, bias, masked)
        copies = [None if t is None else t.detach().double() for t in inputs]
        torch.testing.assert_close(fused_grid.grid_conv_eager(*copies, mask, *grid, prefix, norm_eps),
                                   grid_conv_reference(*copies, mask, grid, prefix, norm_eps), atol=1e-12, rtol=0)


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
        _, stats, _ = fused_ttt.run_ttt(qv, k[:1], qv, None, *weights, d ** -0.5, 1.0, filters, bias, filters, bias,
                                        eps, side, side, 1)
    assert_exact(stats, torch.ones(1, N, dtype=torch.bool), k[:1])


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
def test_the_variants_run_their_convs_in_their_own_kernels(variant, form):
    """No grid kernel: TTT where a program owns a head (its key norm, both convs and their backward are the step
    kernels'; where heads split, the grid kernels: test_a_grid_kernel_the_gpu_cannot_build_leaves_the_convs_to_torch);
    MHLA in either form, whose kernels add LePE in their epilogues (the blocked form's read-out, its state backward
    taking LePE's gradient)."""
    dispatch.current().settings = dispatch.KernelSettings(form=form)
    module = helpers.make_module(variant, 1, (4, 4), dim=64, dtype=torch.float32).to(DEVICE)
    ran = grid_launches(variant, torch.randn(1, 17, 64, device=DEVICE), module)  # (one image: the interpreter is slow)
    assert not {"grid_conv_bwd_kernel", "key_moments_kernel"} & set(ran), ran
    assert ("pairwise_fwd_kernel" in ran) == (form == "pairwise"), ran
    assert ("readout_fwd_kernel" in ran) == (form == "blocked"), ran


def test_a_grid_kernel_the_gpu_cannot_build_leaves_the_convs_to_torch():
    """TTT's convs run inside its step op, whose backward runs the grid backward kernel where heads split over token
    ranges (in one program a head its own kernel takes it). Where Triton cannot build it, that step's gradients
    come from the op's eager form, the kernels' own; one warning, the grid kernels off for the process and the step
    on its kernels (with the convs in torch from then on)."""
    split_heads()
    module = helpers.make_module("ttt", 1, (4, 4), dim=64, dtype=torch.float32).to(DEVICE)
    x = torch.randn(1, 17, 64, device=DEVICE, requires_grad=True)  # (one image: the interpreter runs a program per
    grad = torch.randn(1, 17, 64, device=DEVICE)                    # image, head and token range)
    want = torch.autograd.grad(module(x), [x, *module.parameters()], grad)
    dispatch.current().unavailable.clear()
    out = module(x)
    helpers.cramped(("grid_conv_bwd_kernel",))
    with pytest.warns(RuntimeWarning, match="cannot run on this GPU .*for grid_conv"):
        got = torch.autograd.grad(out, [x, *module.parameters()], grad)
    assert not dispatch.can_run(x, "grid_conv")
    assert dispatch.can_run(x, "ttt_step")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    with helpers.no_warnings():
        module(x)  # (no second warning)
