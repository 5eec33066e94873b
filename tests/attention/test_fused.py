"""The fused Triton kernels (ops/linear/op.py) against the eager forms and the explicit N×N references.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py
before anything imports triton): the same kernel code, executed with numpy. Values and gradients of q, k, v
(and of the module's parameters, MHLA's W included) in float32 and bfloat16, with key masks, token counts
that are not a multiple of the chunk, prefix tokens, several token ranges per head, and head dims 32/64/96.
On a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch
from helpers import load_benchmark

from vitconvert.attention.kernel import elu_feature_literal
from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.linear import op as fused
from vitconvert.attention.ops.linear.reference import inline_weights, kernel_attention_reference

from . import helpers
from .fused_cases import (
    DEVICE,
    DTYPES,
    ORACLES,
    TOL,
    assert_matches_oracle,
    kernels_here,  # noqa: F401  (an autouse fixture: the kernels on this device)
    make_module,
    padding_mask,
    qkv,
)
from .helpers import rel_error


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("name", ["elu", "relu"])
def test_kernel_attention_matches_the_n_by_n_form_values_and_gradients(name, masked, dtype):
    feature, phi = ORACLES[name]
    q, k, v = qkv(N=150, dtype=dtype)  # 150 tokens: three ranges of 64, the last one partly filled
    mask = padding_mask(2, 150) if masked else None
    out = fused.attention(q, k, v, mask, feature, 0.0, 1e-6, 1.0, False)
    assert out.dtype == dtype and out.shape == q.shape
    got = assert_matches_oracle(out, (q, k, v), lambda q, k, v: kernel_attention_reference(phi(q), phi(k), v, mask,
                                                                                          1e-6), TOL[dtype])
    if masked:  # a padded key gets no gradient and changes no output
        assert got[1][-1, :, 50:].abs().max() == 0 and got[2][-1, :, 50:].abs().max() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_inline_matches_its_explicit_weights(masked, dtype):
    q, k, v = qkv(N=99, d=64, dtype=dtype)
    mask = padding_mask(2, 99) if masked else None
    scale = 64 ** -0.5
    out = fused.attention(q, k, v, mask, fused.IDENTITY, 0.0, 0.0, scale, True)
    assert_matches_oracle(out, (q, k, v), lambda q, k, v: inline_weights(q, k, mask, scale) @ v, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("name", ["elu", "relu", "inline"])
def test_a_head_in_one_program_runs_forward_and_backward_in_one_launch_each(name, masked, dtype, monkeypatch):
    """Every head's tokens in one program (150 tokens: three chunks, the last partly filled): the forward and the
    backward are one kernel each (the state, dR and dS in registers), values and gradients against the N×N form
    within the same bars as the split heads' kernels (the tests above)."""
    dispatch.current().programs = 1
    q, k, v = qkv(N=150, d=64 if name == "inline" else 32, dtype=dtype)
    mask = padding_mask(2, 150) if masked else None
    launched = []

    def count(kernel, grid, *args, **kwargs):
        launched.append(dispatch.kernel_name(kernel))
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    with dispatch.launches_through(count, DEVICE):
        if name == "inline":
            out = fused.attention(q, k, v, mask, fused.IDENTITY, 0.0, 0.0, 64 ** -0.5, True)
            got = assert_matches_oracle(out, (q, k, v), lambda q, k, v: inline_weights(q, k, mask, 64 ** -0.5) @ v,
                                        TOL[dtype])
        else:
            feature, phi = ORACLES[name]
            out = fused.attention(q, k, v, mask, feature, 0.0, 1e-6, 1.0, False)
            got = assert_matches_oracle(out, (q, k, v), lambda q, k, v: kernel_attention_reference(
                phi(q), phi(k), v, mask, 1e-6), TOL[dtype])
    assert launched == ["attention_fwd_kernel", "attention_bwd_kernel"]
    if masked:  # a padded key gets no gradient
        assert got[1][-1, :, 50:].abs().max() == 0 and got[2][-1, :, 50:].abs().max() == 0


def test_output_is_laid_out_for_the_heads_merge():
    """(B, H, N, d) stored as (B, N, H, d): the module's transpose(1, 2).reshape is a view, not a copy."""
    q, k, v = qkv()
    out = fused.attention(q, k, v, None, fused.RELU, 0.0, 1e-6, 1.0, False)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("name", ["elu", "inline", "mhla", "ttt"])
def test_a_layers_backward_makes_no_token_sized_copy(name):
    """The backwards write dq, dk, dv stored as (B, N, H, d), and the layer unbinds q, k, v before the heads'
    transpose: the qkv projection's (B, N, 3C) gradient is one stack of their rows (softmax's permute-then-unbind
    stacks and then copies), and TTT's convs and MHLA's RMSNorm backward read views of them, no copy."""
    dispatch.current().split_round = 16  # (17 tokens: two ranges a head, TTT's split kernels and its torch convs)
    recorder = load_benchmark("op_traffic").OpTraffic(2 * 16 * 64)  # q's elements on the 4×4 grid
    module = helpers.make_module(name, 1, (4, 4), dim=64, heads=2, dtype=torch.float32).to(DEVICE)
    x = torch.randn(2, 17, 64, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = module(x)
    with recorder:
        out.float().sum().backward()
    sized = recorder.model.token_sized_by_op
    assert sized["clone"] == 0 and sized["stack"] == 1, dict(sized)
    if name != "elu":  # (the op's own gradients, below: once)
        return
    q, k, v = qkv()
    grads = torch.autograd.grad(fused.attention(q, k, v, None, fused.RELU, 0.0, 1e-6, 1.0, False).sum(), (q, k, v))
    assert all(g.transpose(1, 2).is_contiguous() for g in grads)


@pytest.mark.parametrize("num_prefix", [0, 2])
def test_mhla_adds_lepe_in_the_layout_of_the_heads_merge(num_prefix):
    """MHLA's fused output with LePE added (zeros for the prefix tokens) is still stored as (B, N, H, d): the
    module's transpose(1, 2).reshape stays a view, as for the op's own output."""
    module = make_module("mhla", 32, (4, 4), num_prefix, blocks_per_side=2)
    q, k, v = (t.detach() for t in qkv(B=2, H=2, N=num_prefix + 16, d=32))
    out = module.mix(q, k, v, None, (4, 4))
    assert out.transpose(1, 2).is_contiguous()
    module.fused_kernels = False
    torch.testing.assert_close(out, module.mix(q, k, v, None, (4, 4)), atol=1e-5, rtol=1e-4)




MODULE_CASES = [  # (variant, head dim, grid, prefix tokens, options)
    ("elu", 32, (6, 7), 1, {}),
    ("relu", 96, (4, 4), 0, {}),
    ("inline", 64, (5, 5), 2, {"local_residual": True}),
    ("mhla", 32, (6, 7), 1, {"blocks_per_side": 2}),  # blocks of unequal size (the index table pads)
    ("mhla", 64, (4, 4), 0, {"blocks_per_side": [2, 1]}),
    ("mhla", 32, (5, 5), 2, {"lepe_kernel": 0}),  # one block (block_side 7), no LePE
]


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("name,head_dim,grid,num_prefix,options", MODULE_CASES,
                         ids=[f"{c[0]}-d{c[1]}-{c[2][0]}x{c[2][1]}-p{c[3]}" for c in MODULE_CASES])
def test_module_on_the_kernels_matches_its_reference(name, head_dim, grid, num_prefix, options, masked):
    """The whole attention module (projections, φ, states, W̃, LePE, residuals) fused vs its literal N×N form in
    float64: outputs, input gradients and every parameter gradient."""
    module = make_module(name, head_dim, grid, num_prefix, **options)
    assert module.fused_kernels
    tokens = num_prefix + grid[0] * grid[1]
    x = torch.randn(2, tokens, 2 * head_dim, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    attn_mask = padding_mask(2, tokens)[:, None, None, :] if masked else None
    errors = helpers.float32_against_literal(module, x, attn_mask)
    assert errors.pop("output") < 1e-5
    # W̃'s gradient Σ dR·S + dr·z is a difference of terms ~70× its size here (the prefix segment's share):
    # float32's 1e-7 becomes ~1e-4
    bars = {"block_mix": 1e-3}
    assert not {n: e for n, e in errors.items() if e >= bars.get(n, 1e-4)}, errors




def test_ttt_bf16_step_is_the_float32_step_within_bf16_rounding():
    """TTT's GPU form (bf16 matmuls, float32 statistics and fast weights) against its float32 form."""
    module = make_module("ttt", 32, (4, 4), 1)
    q, k, v = (t.detach() for t in qkv(B=2, H=2, N=17, d=32))
    exact = module.mix(q, k, v, None, (4, 4))
    half = module.bf16_mix(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, (4, 4))
    assert half.dtype == torch.bfloat16 and rel_error(half, exact) < 2e-2  # the step dominates at the default lr


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("name", ["elu", "relu", "inline"])
def test_one_launch_and_split_heads_give_the_same_values_and_gradients(name, masked, monkeypatch):
    """A head per program (one kernel for the forward) or heads split over token ranges (state and read-out
    kernels, partial states summed): the same outputs and gradients, and both those of the N×N form."""
    mask = padding_mask(2, 150) if masked else None

    def run(programs: int):
        dispatch.current().programs = programs
        q, k, v = qkv(N=150, d=64)
        if name == "inline":
            out = fused.attention(q, k, v, mask, fused.IDENTITY, 0.0, 0.0, 64 ** -0.5, True)
        else:
            out = fused.attention(q, k, v, mask, ORACLES[name][0], 0.0, 1e-6, 1.0, False)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    assert dispatch.split_tokens(4, 1, 150, torch.device(DEVICE)) == (3, 64)  # the split form, at 64 programs
    split = run(64)
    dispatch.current().split_round = 256
    assert dispatch.split_tokens(4, 1, 150, torch.device(DEVICE))[0] == 1
    whole = run(64)
    for a, b in zip(whole, split, strict=True):
        assert rel_error(a, b) < 1e-6
    q, k, v = (t.detach().double() for t in qkv(N=150, d=64))
    if name == "inline":
        expected = inline_weights(q, k, mask, 64 ** -0.5) @ v
    else:
        phi = ORACLES[name][1]
        expected = kernel_attention_reference(phi(q), phi(k), v, mask, 1e-6)
    assert rel_error(whole[0], expected) < TOL[torch.float32]


def test_the_blocked_op_keeps_the_raw_q_k_and_v_and_normalises_them_itself():
    """With MHLA's RMSNorm weights the op keeps q, k, v as given (views of the qkv projection in a layer), no
    normalised copy and no o (its backward takes do·o from do and R); values and gradients (weights included) equal
    the RMSNorm applied outside the op, and the op with one segment and no index equals kernel attention."""
    from vitconvert.attention.blocks import extended_block_mix, segment_index
    from vitconvert.attention.ops.norms.lean import rms_over_heads

    g = torch.Generator().manual_seed(3)
    qkv_out = torch.randn(2, 20, 3, 2, 32, generator=g).to(DEVICE).requires_grad_()
    q, k, v = qkv_out.permute(2, 0, 3, 1, 4).unbind(0)
    weights = [(1 + torch.rand(64, generator=g)).to(DEVICE).requires_grad_() for _ in range(2)]
    index = segment_index((4, 4), (2, 2), 4, q.device)
    mixing = extended_block_mix(torch.rand(4, 4, generator=g, device=DEVICE)).requires_grad_()
    out = fused.blocked_attention(q, k, v, None, index, mixing, fused.RELU_PLUS_EPS, 1e-6, 1e-6, *weights, 1e-6)[0]
    big = [t for t in out.grad_fn.saved_tensors if t is not None and t.numel() >= q.numel()]
    assert len(big) == 3
    assert all(t.untyped_storage().data_ptr() == qkv_out.untyped_storage().data_ptr() for t in big[:3])
    outside = fused.blocked_attention(rms_over_heads(q, weights[0], 1e-6), rms_over_heads(k, weights[1], 1e-6), v,
                                      None, index, mixing, fused.RELU_PLUS_EPS, 1e-6, 1e-6)[0]
    grad = torch.randn_like(out)
    inputs = [qkv_out, mixing, *weights]
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(outside, inputs, grad),
                         strict=True):
        assert rel_error(got, want) < 1e-5
    assert rel_error(out, outside) < 1e-6
    one = fused.blocked_attention(q, k, v, None, None, torch.ones(1, 1, device=DEVICE), fused.RELU_PLUS_EPS, 1e-6,
                                  1e-6)[0]
    assert rel_error(one, fused.attention(q, k, v, None, fused.RELU_PLUS_EPS, 1e-6, 1e-6, 1.0, False)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("grid,tokens,form",
                         [((6, 7), 43, "pairwise"), ((4, 4), 17, "blocked"), ((6, 7), 40, "blocked")],
                         ids=["grid-pairwise", "grid-blocked", "no-grid"])
def test_mhla_under_autocast_matches_its_float32_eager_form(grid, tokens, form, dtype, monkeypatch):
    """The training form users run on a GPU (bf16 autocast, the kernels, RMSNorm in the op, the LayerNorm-and-qkv
    Function, LePE) against the float32 eager module: outputs and every gradient (input_norm's, the RMSNorms',
    LePE's and W's included) within bf16 rounding; 43 tokens = a class token and a 6×7 grid (unequal blocks), 17 a
    class token and a 4×4 grid (2×2 blocks: the blocked form's path at a quarter of the tokens), 40 form no grid
    (one segment, no LePE). A padded last item."""
    dispatch.current().settings = dispatch.KernelSettings(form=form)
    module = make_module("mhla", 32, grid, 1, blocks_per_side=2)
    with torch.no_grad():  # norms away from their init (weights 1, biases 0), so a lost weight or bias would show
        for norm in (module.input_norm, module.q_rmsnorm, module.k_rmsnorm):
            norm.weight.uniform_(0.5, 1.5)
        module.input_norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, tokens, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    attn_mask = padding_mask(2, tokens)[:, None, None, :]
    grad = torch.randn(2, tokens, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    results = []
    for fused_on in (True, False):
        module.fused_kernels = fused_on
        x_in = x.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=dtype, enabled=fused_on):
            out = module(x_in, attn_mask=attn_mask)
        params = [p for _, p in module.named_parameters()]
        results.append((out, torch.autograd.grad(out, [x_in, *params], grad.to(out.dtype), allow_unused=True)))
    (out, got), (expected, want) = results
    assert out.dtype == dtype and rel_error(out, expected) < TOL[dtype]
    names = ["x", *(n for n, _ in module.named_parameters())]
    for name, g, w in zip(names, got, want, strict=True):
        assert (g is None) == (w is None), name
        if w is not None:
            assert rel_error(g, w) < 2 * TOL[dtype], name


def expanded_gradient_calls():
    """Each op's call on (B, H, N, d) q, k, v (fused_pairwise and fused_ttt imported here: their modules)."""
    from vitconvert.attention.ops.pairwise import op as fused_pairwise
    from vitconvert.attention.ops.ttt import op as fused_ttt

    segments = torch.tensor([0, 1, 2] * 13 + [2], dtype=torch.int32, device=DEVICE)
    mixing = torch.rand(3, 3, device=DEVICE) + 0.5
    index = torch.arange(40, dtype=torch.int32, device=DEVICE).view(2, 20)
    weights = torch.randn(3, 2, 32, 32, device=DEVICE) * 0.1  # (TTT's W1, W2, W3 of two heads)
    return {
        "elu": lambda q, k, v: fused.attention(q, k, v, None, fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False),
        "inline": lambda q, k, v: fused.attention(q, k, v, None, fused.IDENTITY, 0.0, 0.0, 0.125, True),
        "blocked": lambda q, k, v: fused.segmented_attention(q, k, v, None, index, mixing[:2, :2],
                                                             fused.RELU_PLUS_EPS, 1e-6, 1e-6),
        "pairwise": lambda q, k, v: fused_pairwise.pairwise(q, k, v, None, segments, mixing, fused.RELU_PLUS_EPS,
                                                            1e-6, 1e-6),
        "ttt": lambda q, k, v: fused_ttt.call_step(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, weights, 0.125,
                                                    0.5),
    }


@pytest.mark.parametrize("op", ["elu", "inline", "blocked", "pairwise", "ttt"])
def test_an_expanded_output_gradient_and_strided_inputs_give_the_true_gradients(op):
    """``out.sum().backward()`` hands the backward a gradient whose strides are all 0, and a caller's q may be a
    view whose last dimension is not contiguous: the kernels step through d by 1, so both once read garbage
    (gradients of 1e31). Now: the gradients of the same call on contiguous tensors."""
    call = expanded_gradient_calls()[op]
    q, k, v = qkv(N=40)
    out = call(q, k, v)
    want = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    got = torch.autograd.grad(call(q, k, v).sum(), (q, k, v))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    strided = [t.detach().transpose(-2, -1).contiguous().transpose(-2, -1).requires_grad_() for t in (q, k, v)]
    assert strided[0].stride(-1) != 1
    torch.testing.assert_close(call(*strided), out, atol=0, rtol=0)
    for g, w in zip(torch.autograd.grad(call(*strided).sum(), strided), want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_training_keeps_only_q_k_v_and_the_output():
    """Backward recomputes the d×d state: autograd holds no float32 state (a softmax-sized footprint)."""
    q, k, v = qkv(N=150, d=64)
    out = fused.attention(q, k, v, None, fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert len(saved) == 4 and all(t.shape == q.shape for t in saved)  # q, k, v, o: no (B, H, d, d) state


@pytest.mark.slow  # minutes in the interpreter
@pytest.mark.parametrize("tokens,head_dim", [(1025, 64), (4097, 64), (1025, 128)])
def test_kernels_at_vit_sizes(tokens, head_dim):
    """1024 px (4097 tokens) and 512 px, head dims 64 and 128: ELU and InLine against the N×N forms, values and
    gradients, and MHLA's module (a 32×32 grid in 5×5 blocks) against its reference."""
    q, k, v = qkv(B=1, H=2, N=tokens, d=head_dim)
    elu = elu_feature_literal
    assert_matches_oracle(fused.attention(q, k, v, None, fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False), (q, k, v),
                          lambda q, k, v: kernel_attention_reference(elu(q), elu(k), v, None, 1e-6),
                          TOL[torch.float32], grad_tol=1e-4)
    assert_matches_oracle(fused.attention(q, k, v, None, fused.IDENTITY, 0.0, 0.0, head_dim ** -0.5, True), (q, k, v),
                          lambda q, k, v: inline_weights(q, k, None, head_dim ** -0.5) @ v, TOL[torch.float32],
                          grad_tol=1e-4)
    if tokens == 1025:
        module = make_module("mhla", head_dim, (32, 32), 1, blocks_per_side=5)
        x = torch.randn(1, tokens, 2 * head_dim, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        expected = helpers.literal(module.double(), x.double())
        assert rel_error(module.float()(x), expected) < 1e-5
