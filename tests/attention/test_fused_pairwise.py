"""MHLA's pairwise kernels (ops/pairwise/kernels.py, ops/pairwise/op.py) in Triton's interpreter:
against the literal N×N formula, against the blocked kernels, as an op, and how a call picks its form."""

from __future__ import annotations

import pytest
import torch

from vitconvert.attention.blocks import extended_block_mix, segment_index, token_segments
from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.linear import op as fused
from vitconvert.attention.ops.norms.lean import rms_over_heads
from vitconvert.attention.ops.pairwise import op as fused_pairwise
from vitconvert.attention.ops.pairwise.reference import pairwise_reference
from vitconvert.errors import VitconvertError

from . import helpers
from .fused_cases import ALLOCATIONS, explicit_lepe, launches_and_ops
from .helpers import rel_error

DEVICE = helpers.kernels_device()
EPS = 1e-6
TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-3, torch.float16: 1e-3}  # as tests/attention/test_fused.py's


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    with dispatch.kernels_on(DEVICE, settings=dispatch.KernelSettings()) as inner:  # (the form chosen by cost)
        yield inner


def literal(q, k, v, key_valid, segments, mixing):
    """The op's N×N weights written out, φ = relu + ε (MHLA's feature map)."""
    return pairwise_reference(torch.relu(q) + EPS, torch.relu(k) + EPS, v, key_valid, segments, mixing, EPS)


def inputs(N: int, d: int, G: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, N, d, generator=g).to(DEVICE, dtype).requires_grad_() for _ in range(3))
    segments = torch.randint(0, G, (N,), generator=g, dtype=torch.int32).to(DEVICE)
    mixing = (0.2 + torch.rand(G, G, generator=g)).to(DEVICE).requires_grad_()  # not symmetric: a transpose shows
    return q, k, v, segments, mixing


def padding_mask(N: int) -> torch.Tensor:
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[-1, N // 3:] = False
    return mask.to(DEVICE)


FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
# (N, d, dtype, masked): each size and each dtype with and without a mask (150: tiles of 64, the last partly filled)
OP_CASES = [
    (150, 32, FP32, True), (150, 32, BF16, False), (150, 32, FP16, True),
    (70, 64, FP32, False), (70, 64, BF16, True), (70, 64, FP16, False),
    (40, 96, FP32, False), (40, 96, BF16, True), (40, 96, FP16, True)]


@pytest.mark.parametrize("N,d,dtype,masked", OP_CASES, ids=[
    f"{n}-{d}-{str(t).split('.')[-1]}-{'masked' if m else 'all'}" for n, d, t, m in OP_CASES])
def test_the_op_matches_the_literal_n_by_n_form(N, d, dtype, masked):
    """Values and the gradients of q, k, v and W̃ against the formula in float64."""
    q, k, v, segments, mixing = inputs(N, d, 7, dtype)
    mask = padding_mask(N) if masked else None
    out = fused_pairwise.pairwise(q, k, v, mask, segments, mixing, fused.RELU_PLUS_EPS, EPS, EPS)
    assert out.dtype == dtype and out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    copies = [t.detach().double().requires_grad_() for t in (q, k, v, mixing)]
    expected = literal(*copies[:3], mask, segments, copies[3])
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, (q, k, v, mixing), grad.to(dtype))
    want = torch.autograd.grad(expected, copies, grad)
    assert rel_error(out, expected) < TOL[dtype]
    for name, g, w in zip("q k v W̃".split(), got, want, strict=True):
        assert rel_error(g, w) < 2 * TOL[dtype], name
    if masked:  # a padded key gets no gradient and changes no output
        assert got[1][-1, :, N // 3:].abs().max() == 0 and got[2][-1, :, N // 3:].abs().max() == 0


def test_sixty_four_segments_the_most_it_takes():
    q, k, v, segments, mixing = inputs(100, 32, fused_pairwise.MAX_SEGMENTS, torch.float32)
    out = fused_pairwise.pairwise(q, k, v, None, segments, mixing, fused.RELU_PLUS_EPS, EPS, EPS)
    copies = [t.detach().double().requires_grad_() for t in (q, k, v, mixing)]
    expected = literal(*copies[:3], None, segments, copies[3])
    assert rel_error(out, expected) < TOL[torch.float32]
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, mixing, grad.float())[0]
    assert rel_error(got, torch.autograd.grad(expected, copies[3], grad)[0]) < 1e-4


def test_the_pairwise_and_blocked_ops_agree_and_the_pairwise_keeps_only_the_raw_q_k_v():
    """On MHLA's segments (2 prefix tokens, a 6×7 grid in 2×3 blocks of unequal size) with its RMSNorm in the op:
    the same values and gradients (q, k, v through the qkv projection's output, W̃, the norms' weights) as the
    blocked op; autograd keeps q, k and v as given (views of qkv) and nothing else token-sized, not even o."""
    g = torch.Generator().manual_seed(3)
    grid, counts, prefix = (6, 7), (2, 3), 2
    N = prefix + 42
    qkv_out = torch.randn(2, N, 3, 2, 32, generator=g).to(DEVICE).requires_grad_()
    q, k, v = qkv_out.permute(2, 0, 3, 1, 4).unbind(0)
    weights = [(1 + torch.rand(64, generator=g)).to(DEVICE).requires_grad_() for _ in range(2)]
    mixing = extended_block_mix(torch.rand(6, 6, generator=g).to(DEVICE)).requires_grad_()
    mask = padding_mask(N)
    args = (fused.RELU_PLUS_EPS, EPS, EPS, *weights, 1e-6)
    out = fused_pairwise.pairwise(q, k, v, mask, token_segments(grid, counts, prefix, q.device), mixing, *args)
    big = [t for t in out.grad_fn.saved_tensors if t is not None and t.numel() >= q.numel()]
    assert len(big) == 3 and all(t.untyped_storage().data_ptr() == qkv_out.untyped_storage().data_ptr() for t in big)
    blocked = fused.segmented_attention(q, k, v, mask, segment_index(grid, counts, prefix, q.device), mixing, *args)
    assert rel_error(out, blocked) < 1e-6
    grad = torch.randn_like(out)
    params = [qkv_out, mixing, *weights]
    for name, got, want in zip(["qkv", "W̃", "q norm", "k norm"], torch.autograd.grad(out, params, grad),
                               torch.autograd.grad(blocked, params, grad), strict=True):
        assert rel_error(got, want) < 1e-5, name
    outside = fused_pairwise.pairwise(rms_over_heads(q, weights[0], 1e-6), rms_over_heads(k, weights[1], 1e-6), v,
                                      mask, token_segments(grid, counts, prefix, q.device), mixing,
                                      fused.RELU_PLUS_EPS, EPS, EPS)
    assert rel_error(out, outside) < 1e-6


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lepe_in_the_kernels_epilogues_matches_the_explicit_conv(dtype, masked):
    """LePE added by the forward kernel and differentiated in the dk/dv kernel's epilogue: values and gradients of
    q, k, v, W̃ and the conv's weight and bias against the N×N formula plus the conv written out, in float64 (a 6×7
    grid after 2 prefix tokens: tiles of 64 straddle the prefix and the grid's rows)."""
    grid, prefix = (6, 7), 2
    N = prefix + grid[0] * grid[1]
    q, k, v, segments, mixing = inputs(N, 32, 5, dtype)
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 1, 5, 5, generator=g).to(DEVICE).requires_grad_()
    bias = torch.randn(64, generator=g).to(DEVICE).requires_grad_()
    mask = padding_mask(N) if masked else None
    out = fused_pairwise.pairwise(q, k, v, mask, segments, mixing, fused.RELU_PLUS_EPS, EPS, EPS, None, None, 0.0,
                                  weight, bias, grid, prefix)
    params = (q, k, v, mixing, weight, bias)
    copies = [t.detach().double().requires_grad_() for t in params]
    expected = literal(*copies[:3], mask, segments, copies[3]) + explicit_lepe(copies[2], *copies[4:], mask, grid,
                                                                                prefix)
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, params, grad.to(dtype))
    want = torch.autograd.grad(expected, copies, grad)
    assert rel_error(out, expected) < TOL[dtype]
    for name, g, w in zip("q k v W̃ weight bias".split(), got, want, strict=True):
        assert rel_error(g, w) < 2 * TOL[dtype], name
    if masked:  # a padded key gets no gradient and changes no output
        assert got[2][-1, :, N // 3:].abs().max() == 0


def test_with_the_norm_lepe_and_a_mask_the_op_runs_no_torch_op_and_sums_the_batch_in_its_kernels():
    """Two images, two heads, a key mask, MHLA's RMSNorm and LePE, and W as the module hands it over (6 blocks: the
    class token's segment reads W̃'s row and column of ones, made as the kernels load W): one launch each way and no
    torch op in either but allocations and views (no pad of W, no sum over the batch: the gradients of W, the norm
    weights and LePE summed over the images by the backward's last programs), every ticket back at zero; values and
    every gradient against the N×N reference in float64."""
    from vitconvert.attention.ops.linear.launches import tickets

    g = torch.Generator().manual_seed(11)
    grid, counts, prefix, B, H, d = (6, 7), (2, 3), 1, 2, 2, 16
    N = prefix + grid[0] * grid[1]
    q, k, v = (torch.randn(B, H, N, d, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    mixing = (0.2 + torch.rand(6, 6, generator=g)).to(DEVICE).requires_grad_()
    weight = (torch.randn(H * d, 1, 3, 3, generator=g) / 3).to(DEVICE).requires_grad_()
    bias = torch.randn(H * d, generator=g).to(DEVICE).requires_grad_()
    norms = [(1 + torch.rand(H * d, generator=g)).to(DEVICE).requires_grad_() for _ in range(2)]
    mask, segments = padding_mask(N), token_segments(grid, counts, prefix, q.device)
    inputs = (q, k, v, mixing, weight, bias, *norms)
    counters = tickets(4096, q.device)  # (made before the recording: a first call's zeros are no op of the step)
    runs, out, grad, got = launches_and_ops(
        lambda: fused_pairwise.pairwise(q, k, v, mask, segments, mixing, fused.RELU_PLUS_EPS, EPS, EPS, *norms, 1e-6,
                                        weight, bias, grid, prefix), inputs)
    assert {way: [e for e in run if e.endswith("_kernel")] for way, run in runs.items()} == {
        "forward": ["pairwise_fwd_kernel"], "backward": ["pairwise_bwd_kernel"]}
    for run in runs.values():
        assert {e for e in run if not e.endswith("_kernel")} <= ALLOCATIONS | {"detach"}, run
    assert not counters.any()
    copies = [t.detach().double().requires_grad_() for t in inputs]
    q, k, v, mixing, weight, bias, q_weight, k_weight = copies
    q, k = (x * torch.rsqrt(x.square().mean(dim=(1, 3), keepdim=True) + 1e-6) * w.view(1, H, 1, d)
            for x, w in ((q, q_weight), (k, k_weight)))
    expected = literal(q, k, v, mask, segments, mixing) + explicit_lepe(v, weight, bias, mask, grid, prefix)
    assert rel_error(out, expected) < TOL[torch.float32]
    for name, mine, want in zip(["q", "k", "v", "W", "LePE weight", "LePE bias", "q norm", "k norm"], got,
                                torch.autograd.grad(expected, copies, grad.double()), strict=True):
        assert mine.shape == want.shape, name
        assert rel_error(mine, want) < 2 * TOL[torch.float32], name


MHLA_CASES = [  # (head dim, grid, prefix tokens, options): unequal blocks, one axis split, registers, no LePE
    (32, (6, 7), 1, {"blocks_per_side": 2}),
    (64, (4, 4), 0, {"blocks_per_side": [2, 1]}),
    (32, (5, 5), 4, {"blocks_per_side": 2, "lepe_kernel": 0}),
]


@pytest.mark.parametrize("form", ["pairwise", "blocked"])
@pytest.mark.parametrize("head_dim,grid,num_prefix,options", MHLA_CASES,
                         ids=[f"d{c[0]}-{c[1][0]}x{c[1][1]}-p{c[2]}" for c in MHLA_CASES])
def test_mhla_modules_match_their_literal_form_in_either_form(head_dim, grid, num_prefix, options, form, monkeypatch):
    """The whole module (input LayerNorm, RMSNorms, W̃, LePE) on each form of its kernels against its literal N×N
    ``reference`` in float64, a padded item: outputs, input and every parameter gradient."""
    dispatch.current().settings = dispatch.KernelSettings(form=form)
    calls = set()

    def record(kernel, grid, *args, **kwargs):
        calls.add(dispatch.kernel_name(kernel))
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    dispatch.current().launcher = record
    module = helpers.make_module("mhla", num_prefix, grid, dim=2 * head_dim, dtype=torch.float32, **options)
    with torch.no_grad():
        module.block_mix.add_(torch.rand(module.block_mix.shape, generator=torch.Generator().manual_seed(1)))
    module = module.to(DEVICE)
    tokens = num_prefix + grid[0] * grid[1]
    x = torch.randn(2, tokens, 2 * head_dim, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = padding_mask(tokens)[:, None, None, :]
    with helpers.no_warnings():
        errors = helpers.float32_against_literal(module, x, mask)
    assert ("pairwise_fwd_kernel" in calls, "state_fwd_kernel" in calls) == (form == "pairwise", form == "blocked")
    assert errors.pop("output") < 1e-5
    assert not {n: e for n, e in errors.items() if e >= {"block_mix": 1e-3}.get(n, 1e-4)}, errors


@pytest.mark.parametrize("form", ["pairwise", "blocked"])
def test_a_forward_in_inference_mode_then_a_training_step(form, monkeypatch):
    """The segment tables are built once per grid and kept; the first, made inside torch.inference_mode, must
    not be an inference tensor, which the op's backward may not save (the blocked form's index table was)."""
    from vitconvert.attention import blocks

    dispatch.current().settings = dispatch.KernelSettings(form=form)
    blocks._cached_segment_index.cache_clear()
    blocks._cached_token_segments.cache_clear()
    module = helpers.make_module("mhla", 1, (5, 5), dim=64, dtype=torch.float32, blocks_per_side=2).to(DEVICE)
    x = torch.randn(1, 26, 64, device=DEVICE)  # (one image: the tables are per grid, not per batch)
    with torch.inference_mode():
        expected = module(x)
    x.requires_grad_()
    out = module(x)
    out.sum().backward()
    # Not bitwise: with W̃ requiring grad ATen may take another matmul path (seen on an Intel Xeon: 1.2e-7 off).
    torch.testing.assert_close(out.detach(), expected, atol=1e-6, rtol=1e-5)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_second_backward_of_the_same_step_finds_the_norms_tickets_at_zero():
    """The backward's tickets (the last head program of each image finishes the norm's backward, the last image's
    and batch·head's sum the weights' gradients over the batch) are the split kernels' (made once, at zero); the last
    program puts each back to zero, so a second backward of the same graph (retain_graph) takes the same path and
    gives the same gradients."""
    dispatch.current().settings = dispatch.KernelSettings(form="pairwise")
    module = helpers.make_module("mhla", 1, (2, 2), dim=32, dtype=torch.float32, lepe_kernel=3).to(DEVICE)
    x = torch.randn(2, 5, 32, device=DEVICE, requires_grad=True)
    loss = module(x).square().sum()
    weights = [x, module.q_rmsnorm.weight, module.k_rmsnorm.weight, module.lepe.weight]
    first = torch.autograd.grad(loss, weights, retain_graph=True)
    second = torch.autograd.grad(loss, weights)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(g.abs().sum() > 0 for g in first)


@pytest.mark.parametrize("tokens,segments,head_dim,pairwise", [
    (197, 5, 64, True),     # 224 px: 2×2 blocks of 7×7 and the class token
    (50, 2, 64, True),      # 112 px: one block
    (577, 10, 64, False),   # 384 px: 3×3 blocks
    (1025, 26, 64, False),  # 512 px
    (4097, 82, 64, False),  # 1024 px: 9×9 blocks
    (197, 5, 128, True),
])
def test_the_cheaper_form_is_taken(tokens, segments, head_dim, pairwise):
    """On half inputs; float32 ones take the blocked form (no tensor cores for the N×N dots, and spills)."""
    for dtype in (torch.bfloat16, torch.float16):
        assert fused_pairwise.pairwise_is_cheaper(tokens, segments, head_dim, dtype) is pairwise
    assert not fused_pairwise.pairwise_is_cheaper(tokens, segments, head_dim, torch.float32)


def test_the_form_can_be_forced_and_a_bad_setting_is_refused_at_construction(monkeypatch):
    assert fused_pairwise.pairwise_is_cheaper(4097, 64, 64, torch.float32, "pairwise")
    assert not fused_pairwise.pairwise_is_cheaper(4097, fused_pairwise.MAX_SEGMENTS + 1, 64, torch.bfloat16,
                                                  "pairwise")
    form = dispatch.KernelSettings.read({dispatch.FORM_ENV: " Blocked "}).form
    assert not fused_pairwise.pairwise_is_cheaper(197, 5, 64, torch.bfloat16, form)
    monkeypatch.setenv(dispatch.FORM_ENV, "flash")
    with pytest.raises(VitconvertError, match="VITCONVERT_MHLA_FORM='flash': expected one of auto, pairwise, blocked"):
        helpers.make_module("mhla", 1, (4, 4), dim=64, dtype=torch.float32)


def test_the_op_passes_torch_library_checks():
    q, k, v, segments, mixing = inputs(40, 32, 5, torch.float32)
    mask = padding_mask(40)
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    weights = [(1 + torch.rand(64, device=DEVICE)).requires_grad_() for _ in range(2)]
    lepe = (torch.randn(64, 1, 3, 3, device=DEVICE).requires_grad_(), torch.randn(64, device=DEVICE), 5, 7, 5)
    for extra in ((), (*weights, 1e-6), (None, None, 0.0, *lepe)):
        torch.library.opcheck(fused_pairwise.pairwise_attention,
                              (q, k, v, mask, segments, mixing, fused.RELU_PLUS_EPS, EPS, EPS, *extra),
                              test_utils=tests)


def test_a_forward_kernel_the_gpu_cannot_build_leaves_mhla_on_its_blocked_kernels(monkeypatch):
    """The pairwise kernels turn off with one warning and the call (and every later one) takes the blocked form,
    not the eager one: the same output."""

    dispatch.current().settings = dispatch.KernelSettings(form="pairwise")  # (float32: auto takes the blocked form)
    module = helpers.make_module("mhla", 1, (4, 4), dim=64, dtype=torch.float32, blocks_per_side=2).to(DEVICE)
    x = torch.randn(1, 17, 64, device=DEVICE)  # (one image: the interpreter runs a program per image and head)
    expected = module(x)
    refusing = helpers.cramped(["pairwise_fwd_kernel"])
    blocked = []

    def record(kernel, grid, *args, **kwargs):
        blocked.append(dispatch.kernel_name(kernel) == "state_fwd_kernel")
        return refusing(kernel, grid, *args, **kwargs)

    dispatch.current().launcher = record
    with pytest.warns(RuntimeWarning, match="cannot run on this GPU .*OutOfResources"):
        out = module(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert any(blocked) and not dispatch.fits("pairwise_attention")
    assert dispatch.can_run(x[..., :32], "blocked_attention")
    with helpers.no_warnings():
        module(x)


def test_a_backward_kernel_the_gpu_cannot_build_takes_the_eager_gradients(monkeypatch):

    dispatch.current().settings = dispatch.KernelSettings(form="pairwise")
    module = helpers.make_module("mhla", 1, (4, 4), dim=64, dtype=torch.float32, blocks_per_side=2).to(DEVICE)
    x = torch.randn(1, 17, 64, device=DEVICE, requires_grad=True)  # (one image, as above)
    grad = torch.randn(1, 17, 64, device=DEVICE)
    want = torch.autograd.grad(module(x), [x, *module.parameters()], grad)
    out = module(x)
    helpers.cramped(["pairwise_bwd_kernel"])
    with pytest.warns(RuntimeWarning, match="cannot run on this GPU .*OutOfResources"):
        got = torch.autograd.grad(out, [x, *module.parameters()], grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert not dispatch.fits("pairwise_attention")


def test_at_224_px_the_pairwise_kernels_move_less_than_half_the_blocked_ones(monkeypatch):
    """benchmarks/op_traffic.py's count of the token mixing's bytes (its torch ops and its Triton launches' tensor
    arguments) in one bf16 training step of an MHLA layer at 224 px (197 tokens: 2×2 blocks and the class token;
    head dim 64, two heads here): the blocked form writes and reads float32 d×(d+1) states per block (larger than
    the block's tokens at d = 64), where the pairwise form reads q, k, v and writes
    o, normalising q and k as they load (2 launches: forward, and backward, a program per batch·head whose epilogues
    finish the norm's backward of q and of k): within issue 37's 12 q-sized passes (q, k, v, o forward; q, k, v, do,
    dq, dk, dv backward, and per-layer constants). Here LePE is off (both forms add it in their kernels: the
    pairwise in its epilogues, the blocked in its read-out and state backward, test_split_launches.py); the blocked
    form takes 5 launches (2 forward, each token's 1/rms over heads of k and q taken as they load; 3 backward)."""
    import timm
    from helpers import load_benchmark

    import vitconvert

    script = load_benchmark("op_traffic")
    torch.manual_seed(0)
    source = timm.create_model("vit_small_patch16_224", pretrained=False, depth=1, embed_dim=128, num_heads=2)
    student, _ = vitconvert.convert(source, "mhla", options={"lepe_kernel": 0})
    images = torch.randn(1, 3, 224, 224)
    moved = {}
    for form in ("pairwise", "blocked"):
        dispatch.current().settings = dispatch.KernelSettings(form=form)
        recorder = script.count(student, images, "bf16", 128 * 196, train=True, run_kernels=False)  # (sizes only:
        # each launch counted by its arguments, not run; the same counts, test_mixing_passes.py)
        moved[form] = (recorder.kernels.ops, recorder.mixing.bytes + recorder.mixing_kernels.bytes)
    assert moved["pairwise"][0] == 2 and moved["blocked"][0] == 5, moved  # launches: forward and backward
    assert moved["pairwise"][1] < 0.5 * moved["blocked"][1], moved
    assert moved["pairwise"][1] <= 12 * 197 * 128 * 2, moved  # (q's bf16 bytes)
