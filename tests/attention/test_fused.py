"""The fused Triton kernels (attention/fused.py) against the eager forms and the explicit N×N references.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py
before anything imports triton): the same kernel code, executed with numpy. Values and gradients of q, k, v
(and of the module's parameters, MHLA's W included) in float32 and bfloat16, with key masks, token counts
that are not a multiple of the chunk, prefix tokens, several token ranges per head, and head dims 32/64/96.
On a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from helpers import load_benchmark

from vitconvert.attention import dispatch, fused
from vitconvert.attention.inline import inline_weights
from vitconvert.attention.kernel import elu_feature_literal, kernel_attention_reference, relu_feature
from vitconvert.errors import VitconvertError

from . import helpers
from .helpers import rel_error

pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
if not torch.cuda.is_available() and not dispatch.interpreting():
    pytest.skip("no GPU, and Triton's interpreter was not chosen before triton was imported (tests/conftest.py)",
                allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED_VARIANTS = ("elu", "relu", "inline", "mhla")


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch):
    """The kernels on this machine's device, with token ranges small enough that heads split across programs;
    float32 convolutions of the eager parts (LePE, InLine's residual) in full float32, as the oracles are."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(dispatch, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(dispatch, "SPLIT_ROUND", 64)
    monkeypatch.setattr(dispatch, "_programs_wanted", lambda device: 64)


def qkv(B=2, H=2, N=150, d=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g).to(DEVICE, dtype).requires_grad_() for _ in range(3)]


def padding_mask(B: int, N: int) -> torch.Tensor:
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[-1, N // 3:] = False  # the last item is padded
    return mask.to(DEVICE)


# tolerance of the kernels against a float64 oracle: float32 sums, or bf16 inputs and output (bf16: 1.7e-3 in
# values and 2.3e-3–3.3e-3 in gradients, rounding as a GPU does; 1.2e-2 while the interpreter truncated)
TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-3, torch.float16: 1e-3}  # fp16: 2.0e-4 values, 2.8e-4–4.3e-4 grads
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # float16: `vitconvert bench --amp float16`, autocast fp16


def assert_matches_oracle(out, inputs, oracle, tol: float, grad_tol: Optional[float] = None):
    """``out`` (computed from ``inputs``) against ``oracle`` run on float64 copies of them: values within ``tol``,
    the gradients of every input within ``grad_tol`` (2 × tol by default). Returns the kernels' gradients."""
    copies = [t.detach().double().requires_grad_() for t in inputs]
    expected = oracle(*copies)
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, inputs, grad.to(out.dtype))
    want = torch.autograd.grad(expected, copies, grad)
    assert rel_error(out, expected) < tol
    for g, w in zip(got, want, strict=True):
        assert rel_error(g, w) < (2 * tol if grad_tol is None else grad_tol)
    return got

ORACLES = {
    "elu": (fused.ELU_PLUS_ONE, elu_feature_literal),
    "relu": (fused.RELU, relu_feature),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("name", ["elu", "relu"])
def test_kernel_attention_matches_the_n_by_n_form_values_and_gradients(name, masked, dtype):
    feature, phi = ORACLES[name]
    q, k, v = qkv(N=150, dtype=dtype)  # 150 tokens: three ranges of 64, the last one partly filled
    mask = padding_mask(2, 150) if masked else None
    out = fused.kernel_attention(q, k, v, mask, feature, 1e-6)
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
    out = fused.inline_attention(q, k, v, mask, scale)
    assert_matches_oracle(out, (q, k, v), lambda q, k, v: inline_weights(q, k, mask, scale) @ v, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("name", ["elu", "relu", "inline"])
def test_a_head_in_one_program_runs_forward_and_backward_in_one_launch_each(name, masked, dtype, monkeypatch):
    """Every head's tokens in one program (150 tokens: three chunks, the last partly filled): the forward and the
    backward are one kernel each (the state, dR and dS in registers), values and gradients against the N×N form
    within the same bars as the split heads' kernels (the tests above)."""
    monkeypatch.setattr(dispatch, "_programs_wanted", lambda device: 1)
    q, k, v = qkv(N=150, d=64 if name == "inline" else 32, dtype=dtype)
    mask = padding_mask(2, 150) if masked else None
    launched = []

    def count(kernel, grid, *args, **kwargs):
        launched.append(dispatch.kernel_name(kernel))
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    with dispatch.launches_through(count, DEVICE):
        if name == "inline":
            out = fused.inline_attention(q, k, v, mask, 64 ** -0.5)
            got = assert_matches_oracle(out, (q, k, v), lambda q, k, v: inline_weights(q, k, mask, 64 ** -0.5) @ v,
                                        TOL[dtype])
        else:
            feature, phi = ORACLES[name]
            out = fused.kernel_attention(q, k, v, mask, feature, 1e-6)
            got = assert_matches_oracle(out, (q, k, v), lambda q, k, v: kernel_attention_reference(
                phi(q), phi(k), v, mask, 1e-6), TOL[dtype])
    assert launched == ["attention_fwd_kernel", "attention_bwd_kernel"]
    if masked:  # a padded key gets no gradient
        assert got[1][-1, :, 50:].abs().max() == 0 and got[2][-1, :, 50:].abs().max() == 0


def test_output_is_laid_out_for_the_heads_merge():
    """(B, H, N, d) stored as (B, N, H, d): the module's transpose(1, 2).reshape is a view, not a copy."""
    q, k, v = qkv()
    out = fused.kernel_attention(q, k, v, None, fused.RELU, 1e-6)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("name", ["elu", "inline", "mhla", "ttt"])
def test_a_layers_backward_makes_no_token_sized_copy(name):
    """The backwards write dq, dk, dv stored as (B, N, H, d), and the layer unbinds q, k, v before the heads'
    transpose: the qkv projection's (B, N, 3C) gradient is one stack of their rows (softmax's permute-then-unbind
    stacks and then copies), and TTT's convs and MHLA's RMSNorm backward read views of them, no copy."""
    recorder = load_benchmark("op_traffic").OpTraffic(2 * 64 * 64)  # q's elements on the 8×8 grid
    module = helpers.make_module(name, 1, (8, 8), dim=64, heads=2, dtype=torch.float32).to(DEVICE)
    x = torch.randn(2, 65, 64, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = module(x)
    with recorder:
        out.float().sum().backward()
    sized = recorder.model.token_sized_by_op
    assert sized["clone"] == 0 and sized["stack"] == 1, dict(sized)
    q, k, v = qkv()
    grads = torch.autograd.grad(fused.kernel_attention(q, k, v, None, fused.RELU, 1e-6).sum(), (q, k, v))
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


def make_module(name: str, head_dim: int, grid, num_prefix: int, **options):
    module = helpers.make_module(name, num_prefix, grid, dim=2 * head_dim, dtype=torch.float32, **options)
    if name == "mhla":  # W away from its symmetric init, so a transposed mixing would show
        with torch.no_grad():
            module.block_mix.add_(torch.rand(module.block_mix.shape, generator=torch.Generator().manual_seed(1)))
    return module.to(DEVICE)


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


def test_dispatch_is_eager_where_the_kernels_cannot_go(monkeypatch):
    """CPU tensors (outside these tests), head dims outside 16..128, int tensors, ONNX export: the eager form."""
    monkeypatch.setattr(dispatch, "DEVICES", ("cuda",))
    assert not fused.can_run(torch.zeros(1, 1, 4, 64), "linear_attention")
    monkeypatch.setattr(dispatch, "DEVICES", ("cuda", "cpu"))
    assert fused.can_run(torch.zeros(1, 1, 4, 64), "linear_attention")
    assert not fused.can_run(torch.zeros(1, 1, 4, 8), "linear_attention")
    assert not fused.can_run(torch.zeros(1, 1, 4, 256), "linear_attention")
    assert not fused.can_run(torch.zeros(1, 1, 4, 64, dtype=torch.float64), "linear_attention")


@pytest.mark.parametrize("generation,fused_here", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 9), True),
                                                   ((9, 0), True), ((10, 0), True)])
def test_gpus_before_ampere_run_the_eager_form(generation, fused_here, monkeypatch):
    """A V100 or T4: the kernels built for them spill 400–2,000 registers' worth (benchmarks/kernel_resources.py
    --arch sm_75), so their tensors take the eager form; Ampere on, the kernels. (This machine's tensors stand in
    for a GPU's: its device type is checked as CUDA's is.)"""
    x = torch.zeros(1, 1, 4, 64, device=DEVICE)
    monkeypatch.setattr(dispatch, "GPU_TYPES", (x.device.type,))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: generation)
    monkeypatch.setattr(dispatch, "_capabilities", {})
    assert fused.can_run(x, "linear_attention") is fused_here
    assert fused.can_run(x, "ttt_step", dispatch.TTT_MAX_HEAD_DIM, (torch.float32,)) is fused_here


def test_the_switch_is_read_once_at_construction(monkeypatch):
    monkeypatch.setenv(fused.ENV, "0")
    off = make_module("elu", 32, (4, 4), 1)
    monkeypatch.setenv(fused.ENV, "1")
    on = make_module("elu", 32, (4, 4), 1)
    assert not off.fused_kernels and on.fused_kernels
    calls = []
    monkeypatch.setattr(fused, "linear_state", lambda *a: calls.append(a) or (_ for _ in ()).throw(AssertionError))
    x = torch.randn(1, 17, 64, device=DEVICE)
    off(x)  # the eager form: never reaches the kernels
    assert calls == []


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("False", False), ("no", False), ("1", True),
                                       ("on", True), ("TRUE", True), ("", True), (" 0 ", False)])
def test_the_switch_takes_the_usual_spellings(monkeypatch, value, on):
    monkeypatch.setenv(fused.ENV, value)
    assert make_module("elu", 32, (4, 4), 1).fused_kernels is on


@pytest.mark.parametrize("name, value", [("VITCONVERT_FUSED", "maybe"), ("VITCONVERT_FUSED", "2"),
                                         ("VITCONVERT_FUSED_TILE", "bf16"), ("VITCONVERT_FUSED_CONFIG", "64"),
                                         ("VITCONVERT_FUSED_CONFIG", "33,4"), ("VITCONVERT_FUSED_CONFIG", "64,3"),
                                         ("VITCONVERT_FUSED_CONFIG", "a,b"), ("VITCONVERT_FUSED_CONFIG", "8,4")])
def test_a_bad_setting_is_refused_at_construction_not_ignored(monkeypatch, name, value):
    """``VITCONVERT_FUSED=false`` used to mean on (anything but "0"); a typo in the tuning variables failed deep in
    a launch or fell back to the default silently. Now any of them is a one-line error before a model is made."""
    monkeypatch.setenv(name, value)
    with pytest.raises(VitconvertError, match=f"^{name}='{value}': expected"):
        make_module("elu", 32, (4, 4), 1)


def test_the_tuning_settings_reach_the_launches(monkeypatch):
    monkeypatch.setenv(dispatch.CONFIG_ENV, "128,16")
    monkeypatch.setenv(dispatch.TILE_ENV, " Half ")
    make_module("elu", 32, (4, 4), 1)
    assert dispatch.block_sizes(64) == (128, 64, 16)
    assert dispatch.pipeline_stages() == 3  # (none given: the default)
    assert dispatch.tile_args(torch.zeros(1, dtype=torch.bfloat16))["PRECISION"] == "ieee"  # 16-bit tiles
    monkeypatch.setenv(dispatch.TILE_ENV, "tf32")
    assert dispatch.tile_args(torch.zeros(1, dtype=torch.bfloat16))["PRECISION"] == "tf32"


@pytest.mark.parametrize("variant", ["elu", "inline"])
def test_num_stages_reaches_every_launch_of_the_linear_ops(monkeypatch, variant):
    """``VITCONVERT_FUSED_CONFIG``'s third number is the pipeline depth (num_stages) of the ELU/ReLU/InLine kernels,
    one launch and split, forward and backward; the output is the same as on the default depth."""
    launches = []

    def record(kernel, grid, *args, **kwargs):
        launches.append((dispatch.kernel_name(kernel), kwargs["num_stages"]))
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    q, k, v = qkv(N=70, d=16)
    call = {"elu": lambda: fused.kernel_attention(q, k, v, None, fused.ELU_PLUS_ONE, 1e-6),
            "inline": lambda: fused.inline_attention(q, k, v, None, 0.25)}[variant]
    default = call()
    monkeypatch.setenv(dispatch.CONFIG_ENV, "64,4,2")
    for wanted in (lambda device: 64, lambda device: 1):  # heads split over token ranges, then a head per program
        monkeypatch.setattr(dispatch, "_programs_wanted", wanted)
        with dispatch.launches_through(record, DEVICE):
            out = call()
            out.sum().backward()
        torch.testing.assert_close(out, default, rtol=1e-5, atol=1e-6)
    assert {name for name, _ in launches} == {"state_fwd_kernel", "readout_fwd_kernel", "readout_bwd_kernel",
                                              "state_bwd_kernel", "attention_fwd_kernel", "attention_bwd_kernel"}
    assert {stages for _, stages in launches} == {2}


@pytest.mark.parametrize("version, head_dim, config, chunk", [
    ("3.6.0", 64, None, 32), ("3.8.0", 64, None, 64), ("3.6.0", 32, None, 64), ("3.6.0", 64, "64,4", 64),
    (None, 64, None, 64)])
def test_older_triton_halves_the_chunk_of_the_backwards_it_spills_in(version, head_dim, config, chunk, monkeypatch):
    monkeypatch.setattr(dispatch, "triton_version", lambda: version)
    dispatch.older_triton.cache_clear()
    if config:
        monkeypatch.setenv(dispatch.CONFIG_ENV, config)
    try:
        block_n, block_d, _ = dispatch.block_sizes(head_dim)
        assert dispatch.spill_free_chunk(block_n, block_d) == chunk
    finally:
        dispatch.older_triton.cache_clear()


@pytest.mark.parametrize("variant, kernel, chunk", [("elu", "attention_bwd_kernel", 32),
                                                    ("mhla", "pairwise_bwd_dkv_kernel", 16)])
def test_the_halved_backward_chunks_reach_the_kernels_and_give_the_same_gradients(variant, kernel, chunk,
                                                                                   monkeypatch):
    """Under Triton before 3.8 (dispatch.spill_free_chunk) the one-launch backward and MHLA's pairwise dk/dv run
    on half the token chunk at head dim 64; their gradients are those of the whole chunk."""
    monkeypatch.setenv(dispatch.FORM_ENV, "pairwise")
    module = make_module(variant, 64, (4, 4), 1)
    x = torch.randn(2, 17, 128, device=DEVICE)
    grad = torch.randn(2, 17, 128, device=DEVICE)

    def gradients(older: bool) -> tuple[list, list]:
        monkeypatch.setattr(dispatch, "older_triton", lambda: older)
        chunks = []

        def record(kernel_fn, grid, *args, **kwargs):
            chunks.append((kernel_fn.fn.__name__, kwargs["BLOCK_N"]))
            return dispatch.build_and_run(kernel_fn, grid, *args, **kwargs)

        with dispatch.launches_through(record, DEVICE):
            inputs = x.clone().requires_grad_()
            found = torch.autograd.grad(module(inputs), [inputs, *module.parameters()], grad)
        return found, [c for name, c in chunks if name == kernel]

    (lean, lean_chunks), (whole, whole_chunks) = gradients(True), gradients(False)
    assert lean_chunks == [chunk] and whole_chunks == [2 * chunk]
    for a, b in zip(lean, whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_mhla_official_denominator_stays_eager(monkeypatch):
    module = make_module("mhla", 32, (4, 4), 1, blocks_per_side=2, denominator="official")
    monkeypatch.setattr(fused, "segmented_attention", lambda *a: (_ for _ in ()).throw(AssertionError("fused")))
    x = torch.randn(1, 17, 64, device=DEVICE)
    torch.testing.assert_close(module(x), helpers.literal(module, x), atol=1e-5, rtol=1e-4)


def test_custom_ops_pass_torch_library_checks():
    """torch.library.opcheck: schema, fake (meta) kernels and autograd registration agree with the real op —
    what torch.compile and torch.export rely on to treat each kernel as one op."""
    q, k, v = qkv(B=1, H=2, N=40, d=32)
    mask = padding_mask(1, 40)
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(fused.linear_state, (k, v, mask, None, fused.ELU_PLUS_ONE, 0.0), test_utils=tests)
    S, z, _ = fused.linear_state(k, v, mask, None, fused.ELU_PLUS_ONE, 0.0)
    torch.library.opcheck(fused.linear_readout, (q, S.detach(), z.detach(), None, fused.ELU_PLUS_ONE, 0.0, 1e-6,
                                                 True), test_utils=tests)
    from vitconvert.attention.blocks import extended_block_mix, segment_index

    index = segment_index((6, 6), (2, 3), 4, q.device)  # 4 prefix tokens + 36 on the grid: N = 40
    mixing = extended_block_mix(torch.rand(6, 6, device=DEVICE)).requires_grad_()
    torch.library.opcheck(fused.blocked_attention, (q, k, v, mask, index, mixing, fused.RELU_PLUS_EPS, 1e-6, 1e-6),
                          test_utils=tests)
    weights = [(1 + torch.rand(64, device=DEVICE)).requires_grad_() for _ in range(2)]  # MHLA's RMSNorm in the op
    for table, mix, recompute in ((index, mixing, True), (None, torch.ones(1, 1, device=DEVICE), False)):
        torch.library.opcheck(fused.blocked_attention, (q, k, v, mask, table, mix, fused.RELU_PLUS_EPS, 1e-6, 1e-6,
                                                        *weights, 1e-6, recompute), test_utils=tests)
    for inline in (False, True):
        torch.library.opcheck(fused.linear_attention, (q, k, v, mask, fused.RELU, 0.0, 1e-6, 0.125, inline),
                              test_utils=tests)


@pytest.mark.parametrize("form", ["pairwise", "blocked"])
def test_compiles_as_one_graph(form, monkeypatch):
    """torch.compile sees the kernels as custom ops: no graph break (fullgraph), same values as eager."""
    monkeypatch.setenv(dispatch.FORM_ENV, form)
    torch._dynamo.reset()
    module = make_module("mhla", 32, (4, 4), 1, blocks_per_side=2)
    x = torch.randn(2, 17, 64, device=DEVICE, requires_grad=True)
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
    monkeypatch.setattr(dispatch, "GPU_TYPES", (x.device.type,))
    monkeypatch.setattr(torch.cuda, "get_device_capability", untraceable)
    monkeypatch.setattr(dispatch, "_capabilities", {})
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
        monkeypatch.setattr(dispatch, "_programs_wanted", lambda device: programs)
        q, k, v = qkv(N=150, d=64)
        if name == "inline":
            out = fused.inline_attention(q, k, v, mask, 64 ** -0.5)
        else:
            out = fused.kernel_attention(q, k, v, mask, ORACLES[name][0], 1e-6)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    assert fused.split_tokens(4, 1, 150, torch.device(DEVICE)) == (3, 64)  # the split form, at 64 programs
    split = run(64)
    monkeypatch.setattr(dispatch, "SPLIT_ROUND", 256)
    assert fused.split_tokens(4, 1, 150, torch.device(DEVICE))[0] == 1
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


@pytest.mark.parametrize("recompute", [False, True], ids=["keeps-o", "recomputes-o"])
def test_the_blocked_op_keeps_the_raw_q_k_and_v_and_normalises_them_itself(recompute):
    """With MHLA's RMSNorm weights the op keeps q, k, v as given (views of the qkv projection in a layer), no
    normalised copy, and o only when asked; values and gradients (weights included) equal the RMSNorm applied
    outside the op, and the op with one segment and no index equals kernel attention."""
    from vitconvert.attention.blocks import extended_block_mix, segment_index
    from vitconvert.attention.lean_norms import rms_over_heads

    g = torch.Generator().manual_seed(3)
    qkv_out = torch.randn(2, 40, 3, 2, 32, generator=g).to(DEVICE).requires_grad_()
    q, k, v = qkv_out.permute(2, 0, 3, 1, 4).unbind(0)
    weights = [(1 + torch.rand(64, generator=g)).to(DEVICE).requires_grad_() for _ in range(2)]
    index = segment_index((6, 6), (2, 3), 4, q.device)
    mixing = extended_block_mix(torch.rand(6, 6, generator=g, device=DEVICE)).requires_grad_()
    out = fused.blocked_attention(q, k, v, None, index, mixing, fused.RELU_PLUS_EPS, 1e-6, 1e-6, *weights, 1e-6,
                                  recompute)
    big = [t for t in out.grad_fn.saved_tensors if t is not None and t.numel() >= q.numel()]
    assert len(big) == (3 if recompute else 4)
    assert all(t.untyped_storage().data_ptr() == qkv_out.untyped_storage().data_ptr() for t in big[:3])
    outside = fused.blocked_attention(rms_over_heads(q, weights[0], 1e-6), rms_over_heads(k, weights[1], 1e-6), v,
                                      None, index, mixing, fused.RELU_PLUS_EPS, 1e-6, 1e-6)
    grad = torch.randn_like(out)
    inputs = [qkv_out, mixing, *weights]
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(outside, inputs, grad),
                         strict=True):
        assert rel_error(got, want) < 1e-5
    assert rel_error(out, outside) < 1e-6
    one = fused.blocked_attention(q, k, v, None, None, torch.ones(1, 1, device=DEVICE), fused.RELU_PLUS_EPS, 1e-6,
                                  1e-6)
    assert rel_error(one, fused.kernel_attention(q, k, v, None, fused.RELU_PLUS_EPS, 1e-6, 1e-6)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tokens,form", [(43, "pairwise"), (43, "blocked"), (40, "blocked")],
                         ids=["grid-pairwise", "grid-blocked", "no-grid"])
def test_mhla_under_autocast_matches_its_float32_eager_form(tokens, form, dtype, monkeypatch):
    """The training form users run on a GPU (bf16 autocast, the kernels, RMSNorm in the op, the LayerNorm-and-qkv
    Function, LePE) against the float32 eager module: outputs and every gradient (input_norm's, the RMSNorms',
    LePE's and W's included) within bf16 rounding; 43 tokens = a class token and a 6×7 grid (unequal blocks),
    40 form no grid (one segment, no LePE). A padded last item."""
    monkeypatch.setenv(dispatch.FORM_ENV, form)
    module = make_module("mhla", 32, (6, 7), 1, blocks_per_side=2)
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
    from vitconvert.attention import fused_pairwise, fused_ttt

    segments = torch.tensor([0, 1, 2] * 13 + [2], dtype=torch.int32, device=DEVICE)
    mixing = torch.rand(3, 3, device=DEVICE) + 0.5
    index = torch.arange(40, dtype=torch.int32, device=DEVICE).view(2, 20)
    weights = torch.randn(2, 3, 32, 32, device=DEVICE) * 0.1
    return {
        "elu": lambda q, k, v: fused.kernel_attention(q, k, v, None, fused.ELU_PLUS_ONE, 1e-6),
        "inline": lambda q, k, v: fused.inline_attention(q, k, v, None, 0.125),
        "blocked": lambda q, k, v: fused.segmented_attention(q, k, v, None, index, mixing[:2, :2],
                                                             fused.RELU_PLUS_EPS, 1e-6, 1e-6),
        "pairwise": lambda q, k, v: fused_pairwise.pairwise(q, k, v, None, segments, mixing, fused.RELU_PLUS_EPS,
                                                            1e-6, 1e-6),
        "ttt": lambda q, k, v: fused_ttt.fused_step(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, weights, 0.125,
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
    out = fused.kernel_attention(q, k, v, None, fused.ELU_PLUS_ONE, 1e-6)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert len(saved) == 4 and all(t.shape == q.shape for t in saved)  # q, k, v, o: no (B, H, d, d) state


@pytest.mark.slow  # minutes in the interpreter
@pytest.mark.parametrize("tokens,head_dim", [(1025, 64), (4097, 64), (1025, 128)])
def test_kernels_at_vit_sizes(tokens, head_dim):
    """1024 px (4097 tokens) and 512 px, head dims 64 and 128: ELU and InLine against the N×N forms, values and
    gradients, and MHLA's module (a 32×32 grid in 5×5 blocks) against its reference."""
    q, k, v = qkv(B=1, H=2, N=tokens, d=head_dim)
    elu = elu_feature_literal
    assert_matches_oracle(fused.kernel_attention(q, k, v, None, fused.ELU_PLUS_ONE, 1e-6), (q, k, v),
                          lambda q, k, v: kernel_attention_reference(elu(q), elu(k), v, None, 1e-6),
                          TOL[torch.float32], grad_tol=1e-4)
    assert_matches_oracle(fused.inline_attention(q, k, v, None, head_dim ** -0.5), (q, k, v),
                          lambda q, k, v: inline_weights(q, k, None, head_dim ** -0.5) @ v, TOL[torch.float32],
                          grad_tol=1e-4)
    if tokens == 1025:
        module = make_module("mhla", head_dim, (32, 32), 1, blocks_per_side=5)
        x = torch.randn(1, tokens, 2 * head_dim, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        expected = helpers.literal(module.double(), x.double())
        assert rel_error(module.float()(x), expected) < 1e-5


OPS = {"elu": ("linear_attention", "blocked_attention"), "inline": ("linear_attention", "blocked_attention"),
       "mhla": ("blocked_attention", "linear_attention")}  # (the variant's op, another)


def blocked_form(name: str, monkeypatch) -> None:
    """MHLA's kernels in their blocked form (states mixed and read out): at these sizes the call would take the
    pairwise one (tests/attention/test_fused_pairwise.py)."""
    if name == "mhla":
        monkeypatch.setenv(dispatch.FORM_ENV, "blocked")


@pytest.mark.parametrize("name", ["elu", "inline", "mhla"])
def test_a_kernel_the_gpu_cannot_build_falls_back_to_the_eager_form_once(name, monkeypatch):
    blocked_form(name, monkeypatch)
    module = make_module(name, 32, (4, 4), 1, **({"blocks_per_side": 2} if name == "mhla" else {}))
    x = torch.randn(2, 17, 64, device=DEVICE)
    expected = module(x)
    monkeypatch.setattr(dispatch, "_unavailable", {})
    for kernel in ("attention_fwd_kernel", "state_fwd_kernel", "readout_fwd_kernel"):
        monkeypatch.setattr(kernel_home(kernel), kernel, helpers.Unbuildable())
    with pytest.warns(RuntimeWarning, match="cannot run on this GPU .*OutOfResources.*VITCONVERT_FUSED=0"):
        out = module(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    op, other = OPS[name]
    assert not fused.can_run(x, op) and fused.can_run(x, other)  # that op's off: no second warning or try

    with helpers.no_warnings():
        module(x)


def kernel_home(name: str):
    """The module that defines kernel ``name``: where a test replaces it."""
    from vitconvert.attention import head_kernels, split_kernels

    return head_kernels if hasattr(head_kernels, name) else split_kernels


SPLIT_BACKWARD_KERNELS = ("readout_bwd_kernel", "state_bwd_kernel")  # (heads split over programs; MHLA's blocked op)
BACKWARD_KERNELS = (*SPLIT_BACKWARD_KERNELS, "attention_bwd_kernel")  # (a head in one program: ELU, ReLU, InLine)


@pytest.mark.parametrize("name", ["elu", "inline", "mhla"])
def test_a_backward_kernel_the_gpu_cannot_build_falls_back_to_the_eager_gradients(name, monkeypatch):
    """The forward ran on the kernels, backward cannot build one: a warning, that op's kernels off for the process,
    and this step's gradients (inputs and parameters, MHLA's W included) from the ops' eager forms."""
    blocked_form(name, monkeypatch)
    module = make_module(name, 32, (4, 4), 1, **({"blocks_per_side": 2} if name == "mhla" else {}))
    x = torch.randn(2, 17, 64, device=DEVICE, requires_grad=True)
    grad = torch.randn(2, 17, 64, device=DEVICE)
    want = torch.autograd.grad(module(x), [x, *module.parameters()], grad)
    monkeypatch.setattr(dispatch, "_unavailable", {})
    out = module(x)  # forward on the kernels
    for kernel in BACKWARD_KERNELS:
        monkeypatch.setattr(kernel_home(kernel), kernel, helpers.Unbuildable())
    with pytest.warns(RuntimeWarning, match="cannot run on this GPU .*OutOfResources.*VITCONVERT_FUSED=0"):
        got = torch.autograd.grad(out, [x, *module.parameters()], grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    op, other = OPS[name]
    assert not fused.can_run(x, op) and fused.can_run(x, other)  # that op's next step runs eager, unwarned


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_the_eager_forms_of_the_ops_compute_what_the_kernels_compute(masked):
    """fused_eager (the backward fallback) against the kernels: states and read-out over MHLA's segment table
    with its −1 pads and the prefix segment, and the one-segment kernel attention."""
    from vitconvert.attention import fused_eager
    from vitconvert.attention.blocks import segment_index

    q, k, v = (t.detach() for t in qkv(N=1 + 36))
    key_valid = padding_mask(2, 37) if masked else None
    index = segment_index((6, 6), (2, 3), 1, q.device)  # uneven blocks: the table pads with −1
    S, z, zv = fused.linear_state(k, v, key_valid, index, fused.RELU_PLUS_EPS, 1e-3)
    S0, z0, zv0 = fused_eager.state(k, v, key_valid, index, fused.RELU_PLUS_EPS, 1e-3)
    for got, want in ((S, S0), (z, z0), (zv, zv0)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    o = fused.linear_readout(q, S, z, index, fused.RELU_PLUS_EPS, 1e-3, 1e-6, True)
    torch.testing.assert_close(o, fused_eager.readout(q, S, z, index, fused.RELU_PLUS_EPS, 1e-3, 1e-6, True),
                               atol=1e-5, rtol=1e-5)
    for feature, inline in ((fused.ELU_PLUS_ONE, False), (fused.IDENTITY, True)):
        args = (key_valid, feature, 0.0, 1e-6 if not inline else 0.0, 0.5 if inline else 1.0, inline)
        torch.testing.assert_close(fused.linear_attention(q, k, v, *args), fused._attention_eager(q, k, v, *args),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["vit", "eva02", "dinov2", "deit_distilled"])
@pytest.mark.parametrize("name", FUSED_VARIANTS)
def test_whole_timm_models_on_the_kernels_match_their_eager_form(family, name, monkeypatch):
    """Converted timm models as users run them (qkv layouts, rope, registers, distillation tokens), one
    training step: logits and every gradient of the fused model equal the eager model's."""
    from helpers import image_batch, tiny_model

    import vitconvert
    from vitconvert.attention import fused_pairwise

    calls = []
    entry_points = [(fused, "kernel_attention"), (fused, "inline_attention"), (fused, "segmented_attention"),
                    (fused_pairwise, "pairwise")]  # the variants'
    for where, op in entry_points:
        original = getattr(where, op)
        monkeypatch.setattr(where, op, lambda *a, _op=original: calls.append(1) or _op(*a))
    source = tiny_model(family)
    student, _ = vitconvert.convert(source, name)
    student = student.to(DEVICE).train()
    x = image_batch(source).to(DEVICE)
    results = []
    for fused_on in (True, False):
        for module in student.modules():
            if hasattr(module, "fused_kernels"):
                module.fused_kernels = fused_on
        student.zero_grad()
        logits = student(x)
        logits.square().sum().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in student.named_parameters()
                                          if p.grad is not None}))
        if fused_on:
            assert len(calls) == 2  # both blocks ran on the kernels
    assert len(calls) == 2  # and none when switched off
    (fused_logits, fused_grads), (eager_logits, eager_grads) = results
    torch.testing.assert_close(fused_logits, eager_logits, atol=1e-5, rtol=1e-4)
    assert fused_grads.keys() == eager_grads.keys()
    for n in eager_grads:
        torch.testing.assert_close(fused_grads[n], eager_grads[n], atol=1e-5, rtol=1e-3, msg=n)


def saved_mib(model: torch.nn.Module, images: torch.Tensor) -> float:
    """benchmarks/saved_memory.py's measure (what autograd keeps from one bf16-autocast training forward, MiB)."""
    from helpers import load_benchmark

    return load_benchmark("saved_memory").saved_mib(model, images)


# a training step's memory against softmax's (SDPA keeps q, k, v, o and the log-sum-exp), measured as what
# autograd saves: the same on any device. ELU/ReLU/InLine keep exactly softmax's. MHLA also its input LayerNorm's
# input and the normalised q and k (1.51× before the lean RMSNorm and the one-op blocked attention, which keeps
# no states; 1.15× before the RMSNorm moved into the op and the input LayerNorm was fused with the qkv projection,
# which keeps the float32 qkv weight instead of a bf16 copy, hence below 1). TTT keeps q, k, v and recomputes its
# closed-form step in backward (2.32× when autograd kept the step's intermediates).
SAVED_VS_SOFTMAX = {"elu": 1.0, "relu": 1.0, "inline": 1.0, "mhla": 0.94, "ttt": 1.0}


def test_a_training_forward_keeps_no_more_than_its_budget_against_softmax():
    import timm

    import vitconvert

    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=8, embed_dim=96,
                               num_heads=3, depth=2, num_classes=10).to(DEVICE)
    images = torch.randn(2, 3, 64, 64, device=DEVICE)
    softmax = saved_mib(source, images)
    ratios = {name: saved_mib(vitconvert.convert(source, name)[0], images) / softmax for name in SAVED_VS_SOFTMAX}
    over = {name: round(r, 3) for name, r in ratios.items() if r > SAVED_VS_SOFTMAX[name] + 0.005}
    assert not over, (over, ratios)


# -- GPUs other than the H200 the launch settings were made for (dispatch.launch): kernels that do not fit on
# their call site's settings run on leaner ones, 16-bit tiles for half inputs, then smaller token chunks, chosen
# once per kernel; the answers stay the N×N forms' within the same bars. Which settings fit which GPU
# generation: benchmarks/kernel_resources.py --arch (tests/attention/test_kernel_resources.py builds them).


@pytest.fixture
def fresh_dispatch(monkeypatch):
    monkeypatch.setattr(dispatch, "_settled", {})
    monkeypatch.setattr(dispatch, "_unavailable", {})


def l40_at_head_dim_128(settings: dict) -> bool:
    """What fits the read-out's and state's backward at head dim 128 on an L40 (99 KB a block): 16-bit tiles and
    16-token chunks (benchmarks/kernel_resources.py --arch sm_89 --head-dims 128)."""
    return settings["TILE"] != tl.float32 and settings["BLOCK_N"] <= 16


def cramp(monkeypatch, fits, kernels=BACKWARD_KERNELS, module=None) -> dict[str, helpers.Cramped]:
    cramped = {name: helpers.Cramped(getattr(module or kernel_home(name), name), fits) for name in kernels}
    for name, kernel in cramped.items():
        monkeypatch.setattr(module or kernel_home(name), name, kernel)
    return cramped


def test_the_ladder_takes_16_bit_tiles_then_halves_the_chunk():
    bf16_tf32 = {"BLOCK_N": 64, **dispatch._tile_args(torch.bfloat16, False, "tf32", False)}
    assert dispatch.leaner(bf16_tf32, torch.bfloat16) == {"TILE": tl.bfloat16, "PRECISION": "ieee"}
    fp16_tf32 = {"BLOCK_N": 64, **dispatch._tile_args(torch.float16, False, "tf32", False)}
    assert dispatch.leaner(fp16_tf32, torch.float16) == {"TILE": tl.float16, "PRECISION": "ieee"}
    half = {**bf16_tf32, "TILE": tl.bfloat16, "PRECISION": "ieee"}
    assert dispatch.leaner(half, torch.bfloat16) == {"BLOCK_N": 32}
    assert dispatch.leaner({**half, "BLOCK_N": 16}, torch.bfloat16) is None
    # float32 inputs keep the dots' precision the user chose (TF32 or not): only the chunk shrinks
    fp32 = {"BLOCK_N": 32, **dispatch._tile_args(torch.float32, True, "tf32", False)}
    assert dispatch.leaner(fp32, torch.float32) == {"BLOCK_N": 16}


@pytest.mark.parametrize("heads", ["split", "whole"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("name", ["elu", "inline"])
def test_backward_kernels_too_big_for_the_gpu_run_lean_within_the_bf16_bar(name, masked, heads, monkeypatch,
                                                                          fresh_dispatch):
    """bf16 q, k, v; the backward kernels fit only on 16-bit tiles and 16-token chunks: no warning, the kernels
    still run (no eager fallback), and values and gradients keep the N×N form's bf16 bar. ``heads``: split over
    programs (150 tokens: the read-out's and the state's backward), or each in one program (40 tokens: the
    one-launch backward)."""
    kernels = SPLIT_BACKWARD_KERNELS if heads == "split" else ("attention_bwd_kernel",)
    cramped = cramp(monkeypatch, l40_at_head_dim_128, kernels)
    N = 150 if heads == "split" else 40
    mask = padding_mask(2, N) if masked else None
    q, k, v = qkv(N=N, d=64, dtype=torch.bfloat16)
    with helpers.no_warnings():
        if name == "inline":
            out = fused.inline_attention(q, k, v, mask, 64 ** -0.5)
            assert_matches_oracle(out, (q, k, v), lambda q, k, v: inline_weights(q, k, mask, 64 ** -0.5) @ v,
                                  TOL[torch.bfloat16])
        else:
            feature, phi = ORACLES[name]
            out = fused.kernel_attention(q, k, v, mask, feature, 1e-6)
            assert_matches_oracle(out, (q, k, v), lambda q, k, v: kernel_attention_reference(
                phi(q), phi(k), v, mask, 1e-6), TOL[torch.bfloat16])
    assert fused.can_run(q, "linear_attention")  # nothing turned off
    # the first launch of each tried TF32 tiles, then 64- and 32-token chunks (the one-launch backward starts at 32
    # under a Triton older than 3.8: dispatch.spill_free_chunk); the rest took what fitted
    tries = {n: 2 if n == "attention_bwd_kernel" and dispatch.older_triton() else 3 for n in kernels}
    assert {n: c.refused for n, c in cramped.items()} == tries
    assert dispatch.lean_launches() == {n: {"TILE": tl.bfloat16, "PRECISION": "ieee", "BLOCK_N": 16} for n in kernels}
    out = fused.kernel_attention(q, k, v, mask, fused.ELU_PLUS_ONE, 1e-6) if name != "inline" else (
        fused.inline_attention(q, k, v, mask, 64 ** -0.5))
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert {n: c.refused for n, c in cramped.items()} == tries  # remembered


@pytest.mark.parametrize("form", ["blocked", "pairwise"])
def test_an_mhla_module_on_float32_takes_smaller_chunks_and_matches_its_reference(form, monkeypatch, fresh_dispatch):
    """Float32 inputs keep their tiles (the dots' precision is the user's TF32 switch); a GPU where every kernel
    fits only with 16-token chunks runs them all at 16, the whole module within its float32 bars. (The pairwise
    kernels' grid is made of their own BLOCK_M tokens: a smaller chunk of the other side leaves it whole.)"""
    from vitconvert.attention import pairwise_kernels, split_kernels

    monkeypatch.setenv(dispatch.FORM_ENV, form)
    where = split_kernels if form == "blocked" else pairwise_kernels
    kernels = [n for n in dir(where) if n.endswith("_kernel")]
    cramped = cramp(monkeypatch, lambda settings: settings["BLOCK_N"] <= 16, kernels, where)
    module = make_module("mhla", 32, (6, 7), 1, blocks_per_side=2)
    x = torch.randn(2, 43, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with helpers.no_warnings():
        errors = helpers.float32_against_literal(module, x, padding_mask(2, 43)[:, None, None, :])
    assert errors.pop("output") < 1e-5
    assert not {n: e for n, e in errors.items() if e >= {"block_mix": 1e-3}.get(n, 1e-4)}, errors
    launched = {n for n, c in cramped.items() if c.refused}
    assert launched >= ({"state_fwd_kernel", "readout_fwd_kernel", *SPLIT_BACKWARD_KERNELS} if form == "blocked" else
                        {"pairwise_fwd_kernel", "pairwise_bwd_dq_kernel", "pairwise_bwd_dkv_kernel"})
    assert all(step == {"BLOCK_N": 16} for step in dispatch.lean_launches().values())


def test_a_kernel_that_fits_no_settings_still_falls_back_to_eager_once(monkeypatch, fresh_dispatch):
    """Past the last step (16-bit tiles, 16 tokens) the op's kernels turn off with one warning, as before."""
    cramped = cramp(monkeypatch, lambda settings: False)
    q, k, v = qkv(N=150, d=64, dtype=torch.bfloat16)
    out = fused.kernel_attention(q, k, v, None, fused.ELU_PLUS_ONE, 1e-6)
    with pytest.warns(RuntimeWarning, match="OutOfResources"):
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not fused.can_run(q, "linear_attention")
    assert sum(c.refused for c in cramped.values()) == 4  # TF32 64, then 16-bit tiles at 64, 32, 16: one kernel

