"""TTT's step on the Triton kernels (ops/ttt/op.py, ops/ttt/kernels.py) against the closed-form step in
float64 and the module's literal reference (autograd through the per-token inner loss). Kernels in Triton's
interpreter on the CPU, as in test_fused.py: values and gradients of q, k, v and the fast weights, float32 and
bfloat16, masks, token counts that are not a multiple of the chunk, heads split over token ranges, head dims
32/64 (above 64 the module runs its torch step), and the fallbacks where Triton cannot build a kernel."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.ttt import op as fused_ttt

from . import helpers
from .helpers import rel_error

DEVICE = helpers.kernels_device()
KERNELS = ("inner_sums_kernel", "swiglu_readout_kernel", "ttt_fwd_kernel")  # (ops/ttt/kernels.py)
BACKWARD_KERNELS = ("swiglu_readout_bwd_kernel", "ttt_readout_bwd_kernel", "inner_sums_bwd_kernel",  # (backward_
                    "ttt_bwd_kernel")                                                                   # kernels.py)


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch):
    """The kernels on this machine's device, with token ranges short enough that heads split across programs;
    the convs in full float32, as the oracles are; float32 modules on the kernels too, for the oracles' precision
    (a GPU runs TTT's float32 inputs in torch: dispatch.TTT_DTYPES)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    with dispatch.kernels_on(DEVICE, ttt_dtypes=dispatch.DTYPES, split_round=64, programs=64) as inner:
        yield inner


def step_inputs(N: int = 70, d: int = 32, dtype: torch.dtype = torch.float32, masked: bool = False,
                seed: int = 0, batch: int = 2) -> tuple[list[torch.Tensor], Optional[torch.Tensor]]:
    """q, k, v (batch, 2, N, d) and fast weights (3, 2, d, d) large enough that the step moves the read-out."""
    q, k, v = (t.to(DEVICE, dtype).requires_grad_() for t in helpers.random_qkv(batch, 2, N, d, dtype=torch.float32))
    weights = (torch.randn(3, 2, d, d, generator=torch.Generator().manual_seed(seed)) * 2 * d ** -0.5)
    mask = helpers.random_mask(batch, N).to(DEVICE) if masked else None
    return [q, k, v, weights.to(DEVICE).requires_grad_()], mask


def against_float64(inputs: list[torch.Tensor], mask: Optional[torch.Tensor], lr: float = 1.0,
                    form=fused_ttt.call_step):
    """(relative errors of ``form``'s output, the op's by default, then of each input's gradient) against the
    eager step in float64."""
    d = inputs[0].shape[-1]
    out = form(*inputs[:3], mask, inputs[3], d ** -0.5, lr)
    copies = [t.detach().double().requires_grad_() for t in inputs]
    expected = fused_ttt.ttt_eager(*copies[:3], mask, copies[3], d ** -0.5, lr)
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad(out, inputs, probe.to(out))
    want = torch.autograd.grad(expected, copies, probe)
    return [rel_error(out, expected), *(rel_error(g, w) for g, w in zip(got, want, strict=True))]


OP_CASES = [(32, 1, False), (32, 64, True), (64, 1, True), (64, 64, False)]  # (d, programs, masked)


@pytest.mark.parametrize("d,programs,masked", OP_CASES,
                         ids=[f"d{d}-{'split-heads' if p > 1 else 'head-per-program'}-{'masked' if m else 'all'}"
                              for d, p, m in OP_CASES])
def test_the_op_is_the_closed_form_step_values_and_gradients(d, programs, masked, monkeypatch):
    dispatch.current().programs = programs
    inputs, mask = step_inputs(N=70, d=d, masked=masked)
    if programs == 64:
        assert dispatch.split_tokens(4, 1, 70, torch.device(DEVICE))[0] == 2  # two ranges per head, partial sums
    errors = against_float64(inputs, mask, lr=0.7)
    assert max(errors) < 2e-6, errors


def test_the_op_on_raw_keys_applies_the_key_norm_and_both_convs():
    """With the key conv's filters the op takes the raw keys: their instance norm and both residual convs are
    applied as its kernels load the tiles, and backward goes through them into q, k and the filters. Against the
    eager step in float64 (the grid op's eager form for the norm and convs): the output and every gradient, in one
    program a head (the fused kernels; two images, whose gradients of W and the filters the last program of each
    head sums). Heads split over token ranges: test_split_launches.py."""
    dispatch.current().programs = 1
    rows, cols, prefix = 6, 6, 2  # (prefix tokens before a rows × cols grid)
    inputs, mask = step_inputs(N=prefix + rows * cols, d=32, masked=True, batch=2)
    grid = (rows, cols, prefix)
    g = torch.Generator().manual_seed(7)
    convs = [(torch.randn(shape, generator=g) * scale).to(DEVICE).requires_grad_()
             for shape, scale in (((64, 1, 3, 3), 0.3), ((64,), 0.1)) * 2]  # (q's filters and bias, then k's)
    out = fused_ttt.call_step(*inputs[:3], mask, inputs[3], 32 ** -0.5, 0.7, *convs[:2], grid, *convs[2:], 1.0)
    copies = [t.detach().double().requires_grad_() for t in inputs + convs]
    expected = fused_ttt.ttt_eager(*copies[:3], mask, copies[3], 32 ** -0.5, 0.7, *copies[4:6], *grid, *copies[6:],
                                   1.0)
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad(out, inputs + convs, probe.to(out))
    want = torch.autograd.grad(expected, copies, probe)
    errors = [rel_error(out, expected), *(rel_error(a, b) for a, b in zip(got, want, strict=True))]
    assert max(errors) < 5e-6, errors


@pytest.mark.parametrize("d,programs,masked", OP_CASES,
                         ids=[f"d{d}-{'split-heads' if p > 1 else 'head-per-program'}-{'masked' if m else 'all'}"
                              for d, p, m in OP_CASES])
def test_where_the_sums_backward_fits_no_settings_two_kernels_take_its_place(d, programs, masked, monkeypatch):
    """The one-kernel sums' backward holds twelve d×d operands: on an L40 or RTX 4090 (99 KB a block) it fits at
    no settings (benchmarks/kernel_resources.py --arch sm_89). Then a kernel for dk, dW1, dW2 and one for dv, dW3
    take its place: the same gradients against float64, no warning, TTT's kernels stay on, and the one kernel is
    not tried again."""

    dispatch.current().programs = programs
    dispatch.current().unavailable.clear()
    dispatch.current().settled.clear()
    one_kernel = helpers.cramped(["inner_sums_bwd_kernel", "ttt_bwd_kernel"])  # (the one-kernel backward holds as
    # many operands: it does not fit either)
    inputs, mask = step_inputs(N=70, d=d, masked=masked)
    with helpers.no_warnings():
        errors = against_float64(inputs, mask, lr=0.7)
        assert max(errors) < 2e-6, errors
        tries = one_kernel.refused["inner_sums_bwd_kernel"]  # (BLOCK_N 64 or 32, down to 16: float32 keeps its tiles)
        assert tries == (3 if d == 32 else 2)
        assert not dispatch.fits(fused_ttt.ONE_PASS) and dispatch.can_run(inputs[0], "ttt_step")
        against_float64(inputs, mask, lr=0.7)
    assert one_kernel.refused["inner_sums_bwd_kernel"] == tries


def test_the_two_sums_backward_kernels_on_bf16_are_the_one_kernel(monkeypatch):
    """bf16 at head dim 64 (DeiT's), 16-bit tiles: the two kernels' gradients are the one kernel's (the same
    products, in the same order, on the same roundings)."""

    inputs, mask = step_inputs(N=70, d=64, dtype=torch.bfloat16, masked=True)
    inputs[3] = inputs[3].detach().float().requires_grad_()
    one = against_float64(inputs, mask)
    dispatch.current().unavailable.clear()
    helpers.cramped(["inner_sums_bwd_kernel"])
    two = against_float64(inputs, mask)
    assert not dispatch.fits(fused_ttt.ONE_PASS)
    assert two == pytest.approx(one, rel=1e-3), (one, two)


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_inputs_are_as_close_to_float64_as_autocast(dtype, d):
    """bf16 or fp16 q, k, v (and output): the output and every gradient at most as far from the float64 step as
    the same step in torch under autocast (each matmul on 16-bit inputs with float32 accumulation), though
    backward's dots take 16-bit tiles too (TF32 ones overflow shared memory: dispatch.tile_args). The −s/N factor
    scales the d×d sums, not N-sized tensors, so float16 does not underflow (the torch form's bf16_mix is bf16
    only). The interpreter rounds to bf16 as a GPU does (tests/helpers.py)."""
    inputs, mask = step_inputs(N=70, d=d, dtype=dtype, masked=True)
    out = fused_ttt.call_step(*inputs[:3], mask, inputs[3], d ** -0.5, 1.0)
    assert out.dtype == dtype
    errors = against_float64(inputs, mask)

    def under_autocast(*args):
        with torch.autocast(DEVICE, dtype=dtype):
            return fused_ttt.ttt_eager(*args)

    autocast_errors = against_float64(inputs, mask, form=under_autocast)
    assert all(e <= a for e, a in zip(errors, autocast_errors, strict=True)), (errors, autocast_errors)
    assert max(errors) < (1e-2 if dtype == torch.bfloat16 else 2e-3), errors


def test_the_op_at_vit_sizes():  # (4 s in the interpreter)
    """512 px (1025 tokens) at head dim 64."""
    inputs, mask = step_inputs(N=1025, d=64, masked=True, batch=1)  # (one image: the interpreter is slow)
    errors = against_float64(inputs, mask)
    assert max(errors) < 5e-6, errors


@pytest.mark.parametrize("head_dim,dtype,launches", [(64, torch.bfloat16, 1), (96, torch.bfloat16, 0),
                                                     (64, torch.float32, 0)], ids=["d64-bf16", "d96-bf16", "d64-fp32"])
def test_wide_heads_and_float32_inputs_take_the_torch_step(head_dim, dtype, launches, monkeypatch):
    """Above head dim 64, or on float32 inputs, TTT's kernels do not fit an sm_90 GPU (224–456 KB of shared
    memory where a block may have 227; float32: 264 KB with TF32 on, thousands of spilled registers with it off:
    benchmarks/kernel_resources.py --arch sm_90), so the module runs its torch step there; bf16 at 64 its kernels
    (one launch: the key statistics in the step kernel)."""
    module = helpers.make_module("ttt", 1, (4, 4), dim=2 * head_dim, dtype=torch.float32).to(DEVICE)
    ran = []

    def count(kernel, grid, *args, **kwargs):
        ran.append(kernel)
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    with torch.no_grad(), dispatch.kernels_on(launcher=count, ttt_dtypes=dispatch.TTT_DTYPES), torch.autocast(
            DEVICE, dtype=torch.bfloat16, enabled=dtype != torch.float32):
        module(torch.randn(1, 17, 2 * head_dim, device=DEVICE))
    assert len(ran) == launches


def test_the_step_moves_the_read_out():
    """A zero step (lr 0) reads the initial model: the update is not a no-op by accident of the weights."""
    inputs, _ = step_inputs()
    with torch.no_grad():
        moved = fused_ttt.call_step(*inputs[:3], None, inputs[3], 32 ** -0.5, 1.0)
        still = fused_ttt.call_step(*inputs[:3], None, inputs[3], 32 ** -0.5, 0.0)
    assert rel_error(moved, still) > 0.05


def test_masked_keys_take_no_part_and_get_zero_gradients():
    inputs, mask = step_inputs(masked=True)
    out = fused_ttt.call_step(*inputs[:3], mask, inputs[3], 32 ** -0.5, 1.0)
    dq, dk, dv = torch.autograd.grad(out.square().sum(), inputs[:3])
    invalid = ~mask[:, None, :, None].expand_as(dk)
    assert dk[invalid].abs().max() == 0 and dv[invalid].abs().max() == 0
    assert dq[invalid].abs().max() > 0  # their queries still read the updated model
    with torch.no_grad():  # and what they hold does not matter to anyone
        k2, v2 = (t.detach().masked_fill(invalid, 7.0) for t in inputs[1:3])
        again = fused_ttt.call_step(inputs[0], k2, v2, mask, inputs[3], 32 ** -0.5, 1.0)
    torch.testing.assert_close(again, out.detach())


# (head dim, grid, prefix tokens, masked): each grid's convs with and without a key mask across the two head dims;
# without a grid, both
TTT_CASES = [(32, (6, 7), 1, True), (64, (4, 4), 0, False), (32, None, 1, False), (32, None, 1, True)]


@pytest.mark.parametrize("head_dim,grid,num_prefix,masked", TTT_CASES,
                         ids=["d32-6x7-p1-masked", "d64-4x4-p0-all", "d32-nogrid-p1-all", "d32-nogrid-p1-masked"])
def test_module_on_the_kernels_matches_its_reference(head_dim, grid, num_prefix, masked, monkeypatch):
    """The whole TTT module (key norm, convs, the kernels' step, projections) against its literal form in
    float64 (autograd through the per-token inner loss): outputs, input gradients, every parameter gradient."""
    calls = []
    dispatch.current().launcher = lambda kernel, *a, **k: calls.append(1) or dispatch.build_and_run(kernel, *a, **k)
    tokens = num_prefix + (grid[0] * grid[1] if grid else 20)
    module = helpers.make_module("ttt", num_prefix, grid, dim=2 * head_dim, dtype=torch.float32,
                                 inner_lr=1.0).to(DEVICE)  # the reference's step size for weights above the init
    with torch.no_grad():  # fast weights that make the step matter
        for w in (module.fast_w1, module.fast_w2, module.fast_w3):
            w.normal_(std=head_dim ** -0.5, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, tokens, 2 * head_dim, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    attn_mask = helpers.random_mask(2, tokens).to(DEVICE)[:, None, None, :] if masked else None
    errors = helpers.float32_against_literal(module, x, attn_mask)
    assert calls, "the kernels did not run"
    assert errors.pop("output") < 1e-5
    assert max(errors.values()) < 1e-4, errors


def test_the_op_keeps_q_k_v_the_weights_and_the_key_statistics_only():
    """No token-sized intermediate, not even W' (backward recomputes it: at so few tokens W' outweighs what softmax's
    attention keeps beyond TTT's, launch_plan.keeps_summed): q, k, v, the fast weights as given, and
    with the key conv in the op the keys' float32 statistics (2, B, H, d); the convs' filters."""
    inputs, _ = step_inputs()
    out = fused_ttt.call_step(*inputs[:3], None, inputs[3], 32 ** -0.5, 1.0)
    saved = [tuple(t.shape) for t in out.grad_fn.saved_tensors if t is not None and t.numel()]
    assert saved == [(2, 2, 70, 32)] * 3 + [(2, 32, 32)] * 3
    q, k, v = (t.detach()[..., :65, :].requires_grad_() for t in inputs[:3])  # a class token and an 8×8 grid
    filters = [torch.randn(64, 1, 3, 3, device=DEVICE) * 0.1 for _ in range(2)]
    out = fused_ttt.call_step(q, k, v, None, inputs[3], 32 ** -0.5, 1.0, filters[0], None, (8, 8, 1), filters[1],
                              None, 1.0)
    saved = [tuple(t.shape) for t in out.grad_fn.saved_tensors if t is not None and t.numel()]
    assert saved == [(2, 2, 65, 32)] * 3 + [(2, 32, 32)] * 3 + [(2, 2, 2, 32)] + [(64, 1, 3, 3)] * 2


def test_the_op_passes_torch_library_checks_and_compiles_as_one_graph():
    """The op's schema, fake and autograd registration, with W' not kept (40 tokens, one program a head) and kept
    for backward (66 tokens of head dim 16 in two ranges, the room softmax leaves lifted: its third output, W' (B·H,
    3, d, d), in the fake too); one graph under torch.compile."""
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    dispatch.current().softmax_extra_bytes = 1 << 20  # (launch_plan.keeps_summed: W' kept where it weighs ≤ a q)
    for N, d, kept in ((40, 32, (0,)), (66, 16, (4, 3, 16, 16))):
        inputs, mask = step_inputs(N=N, d=d)
        args = (*inputs[:3], mask, *inputs[3], d ** -0.5, 1.0)
        torch.library.opcheck(fused_ttt.ttt_step, args, test_utils=tests)
        assert tuple(fused_ttt.ttt_step(*args)[2].shape) == kept
    torch._dynamo.reset()
    module = helpers.make_module("ttt", 1, (4, 4), dim=64, dtype=torch.float32).to(DEVICE)
    x = torch.randn(1, 17, 64, device=DEVICE, requires_grad=True)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")  # (one image: the interpreter is slow)
    out = compiled(x)
    torch.testing.assert_close(out, module(x), atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(grad, torch.autograd.grad(module(x).sum(), x)[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_a_kernel_the_gpu_cannot_build_falls_back_to_the_eager_step_once(stage, monkeypatch):
    """Forward: the module runs its torch step. Backward (the forward ran on the kernels): this step's gradients
    from the op's eager form. Either way one warning, and TTT's kernels off for the process (the other ops keep
    theirs)."""

    module = helpers.make_module("ttt", 1, (4, 4), dim=64, dtype=torch.float32).to(DEVICE)
    x = torch.randn(1, 17, 64, device=DEVICE, requires_grad=True)  # (one image: the interpreter is slow)
    grad = torch.randn(1, 17, 64, device=DEVICE)
    out = module(x)
    want = torch.autograd.grad(out, [x, *module.parameters()], grad)
    dispatch.current().unavailable.clear()
    if stage == "backward":
        out = module(x)
    # (backward's recomputed forward runs the kernels it built)
    helpers.cramped((KERNELS if stage == "forward" else ()) + BACKWARD_KERNELS)
    with pytest.warns(RuntimeWarning, match="cannot run on this GPU .*OutOfResources.*VITCONVERT_FUSED=0"):
        if stage == "forward":
            out = module(x)
        got = torch.autograd.grad(out, [x, *module.parameters()], grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert not dispatch.can_run(x, "ttt_step") and dispatch.can_run(x, "linear_attention")  # that op's kernels off
    with helpers.no_warnings():
        module(x)


def test_whole_timm_models_train_on_the_kernels_as_on_the_eager_step(monkeypatch):
    """A converted timm model (DINOv2's class token and registers: the prefix is a count to the kernels, one class
    token as in test_module_on_the_kernels_matches_its_reference), one training step as users run it: logits and
    every gradient as the eager step's; then backward kernels Triton cannot build: the earlier layer's
    recomputation still takes its forward's path, and the gradients are the eager step's. (On its grid the op takes
    the raw keys and recomputes in its own backward: ``recompute_step`` off runs the same launches, TTTAttention.mix.)
    """
    from helpers import image_batch, tiny_model

    import vitconvert

    source = tiny_model("dinov2")
    student, _ = vitconvert.convert(source, "ttt")
    student = student.to(DEVICE).train()
    layers = [m for m in student.modules() if hasattr(m, "recompute_step")]
    assert len(layers) == 2 and all(m.recompute_step for m in layers)
    x = image_batch(source, batch=1).to(DEVICE)  # (the interpreter runs a program per image and head)

    def step(fused_on: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for m in layers:
            m.fused_kernels = fused_on
        student.zero_grad()
        logits = student(x)
        logits.square().sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}

    results = [step(True), step(False)]
    dispatch.current().unavailable.clear()
    helpers.cramped(BACKWARD_KERNELS)
    with pytest.warns(RuntimeWarning, match="cannot run on this GPU"):
        results.append(step(True))
    (eager_logits, eager_grads) = results[1]
    for logits, grads in (results[0], *results[2:]):
        torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1e-4)
        assert grads.keys() == eager_grads.keys()
        for n in eager_grads:
            torch.testing.assert_close(grads[n], eager_grads[n], atol=1e-5, rtol=1e-3, msg=n)


def test_ttt_kernels_launch_with_room_for_their_tiles(monkeypatch):
    """TTT's kernels hold up to a dozen d×d tiles: from head dim 64 half the chunk and twice the warps of the
    linear-attention kernels (a guess until measured on a GPU), and the tuning override reaches them too."""
    dispatch.current().settings = dispatch.KernelSettings()
    assert dispatch.block_sizes(64) == (64, 64, 4) and dispatch.block_sizes(64, many_tiles=True) == (32, 64, 8)
    assert dispatch.block_sizes(32, many_tiles=True) == (64, 32, 4)
    dispatch.current().settings = dispatch.KernelSettings.read({dispatch.CONFIG_ENV: "16,2"})
    assert dispatch.block_sizes(64, many_tiles=True) == (16, 64, 2)
    inputs, _ = step_inputs(N=40)  # and the kernels run under it
    assert max(against_float64(inputs, None)) < 2e-6


def test_keeping_w_prime_for_backward_changes_no_bit_of_bf16_gradients():
    """bf16 inputs split over two ranges with a mask: where the plan keeps W' (the room softmax leaves lifted), the
    forward's sums kernel writes it in bf16, the tiles' type the backward reads it in, so the backward that skips
    forming it again gives the very bits of the one that forms it again (float32, rounded as it loads)."""
    inputs, mask = step_inputs(N=66, d=16, dtype=torch.bfloat16, masked=True)
    probe = torch.randn(2, 2, 66, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    runs, kept = [], []

    def keep(t: torch.Tensor) -> torch.Tensor:
        kept.append((tuple(t.shape), t.dtype))
        return t

    for room in (None, 1 << 20):
        dispatch.current().softmax_extra_bytes = room
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = fused_ttt.call_step(*inputs[:3], mask, inputs[3], 16 ** -0.5, 1.0)
        runs.append((out, *torch.autograd.grad(out, inputs, probe)))
        assert (((4, 3, 16, 16), torch.bfloat16) in kept) is (room is not None)
    for recomputed, from_kept in zip(*runs, strict=True):
        assert torch.equal(recomputed, from_kept)
