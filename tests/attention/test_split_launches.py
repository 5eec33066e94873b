"""The split kernels' launches (ops/linear/split_kernels.py): heads split over token ranges run 2 launches forward
and 3 backward with no torch op between them, the last program of each group summing the partials in a fixed order
(ELU's and InLine's states; MHLA's blocked form, whose block states W̃ mixes and whose read-out adds LePE there too;
TTT's step, whose last programs form W' and sum dW' and dW). Kernels in Triton's interpreter on the CPU, as in
test_fused.py."""

from __future__ import annotations

import pytest
import torch

from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.linear import op as fused

from .fused_cases import (
    ALLOCATIONS,
    DEVICE,
    ORACLES,
    TOL,
    kernels_here,  # noqa: F401  (an autouse fixture: the kernels on this device)
    launches_and_ops,
    qkv,
)
from .helpers import rel_error


def assert_two_launches_forward_and_three_backward(runs: dict[str, list[str]], whole: bool = False) -> None:
    """State and read-out forward; state, read-out backward and state backward; between the first launch and the last
    (``whole``: in the whole run) no aten op but allocations and views (no sum, no d×d matmul)."""
    kernels = {d: [e for e in run if e.endswith("_kernel")] for d, run in runs.items()}
    assert kernels == {"forward": ["state_fwd_kernel", "readout_fwd_kernel"],
                       "backward": ["state_fwd_kernel", "readout_bwd_kernel", "state_bwd_kernel"]}
    for run in runs.values():
        launched = [i for i, e in enumerate(run) if e.endswith("_kernel")]
        between = {e for e in (run if whole else run[launched[0]:launched[-1]]) if not e.endswith("_kernel")}
        assert between and between <= ALLOCATIONS | ({"detach"} if whole else set()), between


@pytest.mark.parametrize("name", ["elu", "inline"])
def test_split_heads_take_two_launches_forward_and_three_backward_with_no_torch_op_between(name, monkeypatch):
    """Heads split over token ranges (150 tokens, 3 ranges): the state kernel sums its partial states itself (its
    last program, InLine's R made there too), so the forward is 2 launches and the backward 3."""
    q, k, v = qkv(N=150, d=32)
    if name == "inline":
        runs, *_ = launches_and_ops(lambda: fused.attention(q, k, v, None, fused.IDENTITY, 0.0, 0.0, 32 ** -0.5, True),
                                    (q, k, v))
    else:
        runs, *_ = launches_and_ops(lambda: fused.attention(q, k, v, None, fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False),
                                    (q, k, v))
    assert_two_launches_forward_and_three_backward(runs)


def test_the_blocked_form_mixes_by_w_and_adds_lepe_in_its_kernels():
    """MHLA's blocked op with its RMSNorm, LePE, a key mask and each block's tokens split over two programs, the first
    of two 16-token chunks, two images: each token's 1/rms over heads of k and q taken by the state and read-out
    kernels, k and q normalised as the kernels load them, the state kernel's last program of a batch·head mixes the
    block states by W̃, the read-out adds LePE, the backward's last programs form dS, dW̃ and LePE's filter gradient
    from every chunk's share, the last of each token range's two heads the norm's backward, and the last of the
    batch·heads or ranges the weights' gradients summed over the batch (2 launches forward, 3 backward, no torch op in
    either, every ticket back at zero); W given 2×2 as the module gives it, W̃'s class token row and column made as it
    loads; values and every gradient against the N×N reference in float64 (A_ij = φ(q_i)·φ(k_j)·W̃[s(i), s(j)], LePE a
    conv2d)."""
    from vitconvert.attention.blocks import extended_block_mix, segment_index, token_segments
    from vitconvert.attention.ops.linear.launches import tickets
    from vitconvert.attention.ops.pairwise.reference import pairwise_reference

    g = torch.Generator().manual_seed(8)
    grid, counts, prefix, d = (6, 12), (1, 2), 1, 16  # (two blocks of 36 tokens: ranges of 32 and 4)
    tokens = prefix + grid[0] * grid[1]
    B, H = 2, 2  # (two heads, the norm's sum over them: the interpreter runs each program in turn; two images, the
    # weights' gradients' sum over them)
    q, k, v = qkv(B=B, H=H, N=tokens, d=d)
    mask = torch.ones(B, tokens, dtype=torch.bool, device=DEVICE)
    mask[0, 3:7] = False
    mask[1, 40:44] = False
    mixing = torch.rand(2, 2, generator=g).to(DEVICE).requires_grad_()  # (W as the module passes it: the class
    # token's row and column of W̃ made as the kernels load it)
    weight = (torch.randn(H * d, 1, 3, 3, generator=g) / 3).to(DEVICE).requires_grad_()
    bias = torch.randn(H * d, generator=g).to(DEVICE).requires_grad_()
    norms = [(1 + torch.rand(H * d, generator=g)).to(DEVICE).requires_grad_() for _ in range(2)]
    index = segment_index(grid, counts, prefix, q.device)
    inputs = (q, k, v, mixing, weight, bias, *norms)
    here = dispatch.current()
    here.programs, here.split_round = 1 << 20, 32
    here.settings = dispatch.KernelSettings(config=(16, 4, 1))
    counters = tickets(4096, q.device)  # (made before the recording: a first call's zeros are no op of the step)
    runs, out, grad, got = launches_and_ops(
        lambda: fused.segmented_attention(q, k, v, mask, index, mixing, fused.RELU_PLUS_EPS, 1e-6, 1e-6, *norms, 1e-6,
                                          weight, bias, grid, prefix), inputs)
    assert_two_launches_forward_and_three_backward(runs, whole=True)
    assert not counters.any()
    segments = token_segments(grid, counts, prefix, q.device)
    phi = ORACLES["relu"][1]
    copies = [t.detach().double().requires_grad_() for t in inputs]
    q, k, v, mixing, weight, bias, q_weight, k_weight = copies
    q, k = (x * torch.rsqrt(x.square().mean(dim=(1, 3), keepdim=True) + 1e-6) * w.view(1, H, 1, d)
            for x, w in ((q, q_weight), (k, k_weight)))
    expected = pairwise_reference(phi(q) + 1e-6, phi(k) + 1e-6, v, mask, segments, extended_block_mix(mixing), 1e-6)
    spatial = (v * mask[:, None, :, None])[:, :, prefix:].transpose(2, 3).reshape(B, H * d, *grid)
    lepe = torch.nn.functional.conv2d(spatial, weight, bias, padding=1, groups=H * d).view(B, H, d, -1)
    expected = expected + torch.nn.functional.pad(lepe.transpose(2, 3), (0, 0, prefix, 0))
    assert rel_error(out, expected) < TOL[torch.float32]
    for name, mine, want in zip(["q", "k", "v", "W̃", "LePE weight", "LePE bias", "q norm", "k norm"], got,
                                torch.autograd.grad(expected, copies, grad.double()), strict=True):
        assert rel_error(mine, want) < 2 * TOL[torch.float32], name


@pytest.mark.parametrize("side,ranges,kept", [(6, 3, False), (7, 4, True)])
def test_ttt_split_heads_sum_their_partials_in_the_kernels_and_put_the_tickets_back(side, ranges, kept):
    """TTT's step with heads split over token ranges, two images, a key mask and both convs (the raw keys
    normalised and convolved as the kernels load them): the last program of each batch·head sums the ranges' Ĝ and
    forms W' in inner_sums_kernel, the read-out's backward sums dW', the sums' backward the head's dW over the images
    and ranges, and the convs' backward (ops/grid) the filters' gradients and the norm's sums, so no torch op but
    allocations and views runs between the launches; values and every gradient against the eager step in float64
    (the grid op's eager norm and convs), and every ticket back at 0. Kept: the room softmax leaves lifted (at such
    lengths W' outweighs its logsumexp; the lengths where it does not take minutes here), W' (3·16² float32) weighs
    less than a head's q at 51 tokens (every count of the 49–64 bucket), so the forward keeps it (the op's third
    output, saved for backward) and backward skips the launch that formed it again; at 38 it outweighs q."""
    from vitconvert.attention.ops.launch_plan import keeps_summed
    from vitconvert.attention.ops.linear.launches import tickets
    from vitconvert.attention.ops.ttt import op as fused_ttt

    here = dispatch.current()
    here.ttt_dtypes, here.programs, here.split_round = dispatch.DTYPES, 64, 16
    here.settings = dispatch.KernelSettings(config=(16, 4, 1))
    here.softmax_extra_bytes = 1 << 20  # (the room softmax leaves for kept partials, lifted: KEPT_SHARE decides)
    rows, cols, prefix, H, d = side, side, 2, 2, 16  # (38 tokens: ranges of 16, 16, 6; 51: 16, 16, 16, 3)
    assert dispatch.token_ranges(2 * H, 1, prefix + rows * cols, 64, 16) == (ranges, 16)
    chunks = -(-(prefix + rows * cols) // 16)
    assert keeps_summed(3, d, torch.float32, chunks, 16, here.softmax_extra_bytes) is kept
    assert not keeps_summed(3, d, torch.float32, chunks, 16)  # (softmax's own room: 4 bytes a token a head)
    q, k, v = qkv(B=2, H=H, N=prefix + rows * cols, d=d)
    k.data.mul_(3.0).add_(1.0)  # (a mean and a scale for the key norm to take out)
    mask = torch.ones(2, prefix + rows * cols, dtype=torch.bool, device=DEVICE)
    mask[1, 20:] = False
    g = torch.Generator().manual_seed(7)
    weights = (torch.randn(3, H, d, d, generator=g) * 2 * d ** -0.5).to(DEVICE).requires_grad_()
    convs = [(torch.randn(shape, generator=g) * scale).to(DEVICE).requires_grad_()
             for shape, scale in (((H * d, 1, 3, 3), 0.3), ((H * d,), 0.1)) * 2]  # (q's filters and bias, then k's)
    inputs = (q, k, v, weights, *convs)
    saved: list[tuple[int, ...]] = []  # (the shapes autograd keeps)

    def step() -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            return fused_ttt.call_step(q, k, v, mask, weights, d ** -0.5, 0.7, *convs[:2], (rows, cols, prefix),
                                       *convs[2:], 1.0)

    runs, out, grad, got = launches_and_ops(step, inputs)
    assert {d: [e for e in run if e.endswith("_kernel")] for d, run in runs.items()} == {
        "forward": ["key_moments_kernel", "inner_sums_kernel", "swiglu_readout_kernel"],
        "backward": [*([] if kept else ["inner_sums_kernel"]), "swiglu_readout_bwd_kernel",
                     "inner_sums_bwd_kernel", *["grid_conv_bwd_kernel"] * 3]}  # (q's conv in one launch, k's
    # through its norm in two)
    assert ((2 * H, 3, d, d) in saved) is kept  # (W' among what autograd keeps only where the plan keeps it)
    allocations = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "transpose", "view",
                   "slice"}
    for run in runs.values():
        launched = [i for i, e in enumerate(run) if e.endswith("_kernel")]
        assert {e for e in run[launched[0]:launched[-1]] if not e.endswith("_kernel")} <= allocations, run
    assert not tickets(1, DEVICE).any()
    copies = [t.detach().double().requires_grad_() for t in inputs]
    expected = fused_ttt.ttt_eager(*copies[:3], mask, copies[3], d ** -0.5, 0.7, *copies[4:6], rows, cols, prefix,
                                   *copies[6:], 1.0)
    assert rel_error(out, expected) < 5e-6  # (float32 sums: the bar of the one-program-a-head tests)
    for name, mine, want in zip(["q", "k", "v", "W", "q filter", "q bias", "k filter", "k bias"], got,
                                torch.autograd.grad(expected, copies, grad.double()), strict=True):
        assert rel_error(mine, want) < 5e-6, name


def test_a_new_shape_makes_its_tickets_once_in_its_first_step_and_never_after(monkeypatch):
    """Two training steps of MHLA's blocked op with the norm at a shape whose forward asks more than 4096 tickets (2
    images × 2 heads × 1025 segments) and whose backward asks more still (W̃'s and the norm's besides): the counters
    the forward makes serve its backward and the next step (they grow to a power of two with room, not to the
    count), so the first step allocates them once and the second not at all. Launches skipped, as
    op_traffic.py --sizes-only: only the host's sizes matter."""
    from vitconvert.attention.blocks import segment_index
    from vitconvert.attention.ops.linear import launches

    monkeypatch.setattr(launches, "_tickets", {})
    asked, made_here = [], launches.tickets
    monkeypatch.setattr(launches, "tickets", lambda count, device: asked.append(count) or made_here(count, device))
    B, H, d, grid, prefix = 2, 2, 16, (32, 32), 1
    N = prefix + grid[0] * grid[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    mixing = torch.rand(1024, 1024, generator=g).to(DEVICE).requires_grad_()
    norms = [torch.ones(H * d, device=DEVICE).requires_grad_() for _ in range(2)]
    index = segment_index(grid, grid, prefix, q.device)
    made = []
    with dispatch.launches_through(lambda *args, **kwargs: None, DEVICE):
        dispatch.current().programs = 528  # (an H100's: one token range a head at these counts)
        for _ in range(2):
            out = fused.segmented_attention(q, k, v, None, index, mixing, fused.RELU_PLUS_EPS, 1e-6, 1e-6, *norms,
                                            1e-6)
            made.append(launches._tickets[q.device])
            forward, asked[:] = max(asked), []
            out.backward(torch.ones_like(out))
            made.append(launches._tickets[q.device])
            assert max(asked) > forward >= B * H * (grid[0] * grid[1] + 1) > 4096
            asked.clear()
    assert all(t is made[0] for t in made)
