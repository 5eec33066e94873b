"""The fused ops' direct calls: plain eager calls skip the custom-op dispatcher (an autograd.Function around the
same body), and give exactly the custom ops' values, gradients and saved tensors; every tracer still sees the
ops (dispatch.direct). Kernels in Triton's interpreter on the CPU, as in test_fused.py."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from helpers import load_benchmark
from torch.utils._python_dispatch import TorchDispatchMode

from vitconvert.attention.blocks import extended_block_mix, segment_index
from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.linear import op as fused
from vitconvert.attention.ops.ttt import op as fused_ttt

from . import helpers
from .helpers import random_mask, random_qkv

DEVICE = helpers.kernels_device()


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch):
    with dispatch.kernels_on(DEVICE, ttt_dtypes=dispatch.DTYPES) as inner:  # (float32 TTT on the kernels too)
        yield inner


def qkv(N: int = 40, d: int = 32) -> list[torch.Tensor]:
    return [t.to(DEVICE, torch.float32).requires_grad_() for t in random_qkv(2, 2, N, d)]


def padding_mask(N: int) -> torch.Tensor:
    return random_mask(2, N).to(DEVICE)


def ttt_weights() -> torch.Tensor:
    return (0.2 * torch.randn(3, 2, 32, 32, generator=torch.Generator().manual_seed(6))).requires_grad_()  # 3, H


def blocked_args(lepe: bool):
    q, k, v = qkv(N=17)
    index = segment_index((4, 4), (2, 2), 1, q.device)  # a class token + a 4×4 grid in 2×2 blocks
    mixing = extended_block_mix(torch.rand(4, 4, generator=torch.Generator().manual_seed(3))).requires_grad_()
    weights = [(1 + torch.rand(64, generator=torch.Generator().manual_seed(i))).requires_grad_() for i in (4, 5)]
    g = torch.Generator().manual_seed(7)
    conv = [(torch.randn(64, 1, 3, 3, generator=g) / 3).requires_grad_(), torch.randn(64, generator=g).requires_grad_()]
    return (q, k, v, padding_mask(17), index, mixing, fused.RELU_PLUS_EPS, 1e-6, 1e-6, *weights, 1e-6,
            *(conv if lepe else (None, None)), (4, 4), 1)


CALLS = {
    "elu": lambda: (fused.attention, (*qkv(), padding_mask(40), fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False)),
    "inline": lambda: (fused.attention, (*qkv(d=64), None, fused.IDENTITY, 0.0, 0.0, 0.125, True)),
    "mhla": lambda: (fused.segmented_attention, blocked_args(lepe=False)),
    "mhla-lepe": lambda: (fused.segmented_attention, blocked_args(lepe=True)),  # (LePE in the op's kernels)
    "ttt": lambda: (fused_ttt.call_step, (*qkv(N=17), padding_mask(17), ttt_weights(), 0.125, 0.5)),
}


def through_the_ops() -> None:
    """Every call through the custom ops (dispatch.direct, the one switch, asks the context's dispatch)."""
    dispatch.current().through_ops = True


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def values_and_gradients(form, args, direct: bool) -> list[torch.Tensor]:
    out = form(*args)
    assert type(out.grad_fn).__name__.startswith("Direct") == direct, out.grad_fn  # the path asked for was taken
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out)
    return [out.detach(), *torch.autograd.grad((out * probe).sum(), leaves)]


@pytest.mark.parametrize("case", list(CALLS))
def test_direct_call_gives_the_custom_ops_values_and_gradients(case, monkeypatch):
    form, args = CALLS[case]()
    direct = values_and_gradients(form, args, True)
    through_the_ops()
    through_ops = values_and_gradients(form, args, False)
    assert len(direct) == len(through_ops) > 3
    for a, b in zip(direct, through_ops, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["elu", "mhla-lepe", "ttt"])
def test_direct_call_keeps_what_the_custom_op_keeps(case, monkeypatch):
    """The same tensors saved for backward (MHLA's blocked op: no o), so the memory is the op's."""
    def saved_shapes() -> list[tuple[int, ...]]:
        form, args = CALLS[case]()
        shapes: list[tuple[int, ...]] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            form(*args)
        return sorted(shapes)

    direct = saved_shapes()
    through_the_ops()
    assert direct == saved_shapes() and direct


def test_direct_only_for_plain_eager_calls():
    """Tracers see the custom ops: a dispatch mode (make_fx, op counters), fake tensors, functorch, the compiler."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 3)
    assert dispatch.direct(x)
    with OpNames():
        assert not dispatch.direct(x)
    with FakeTensorMode() as fake_mode:
        fake = fake_mode.from_tensor(x)
    assert not dispatch.direct(fake)
    seen: list[bool] = []
    torch.func.vmap(lambda row: seen.append(dispatch.direct(row)) or row)(x)
    torch.func.grad(lambda t: seen.append(dispatch.direct(t)) or t.sum())(x)
    assert seen == [False, False]
    with warnings.catch_warnings():  # (torch.jit.trace is deprecated; its check reruns the function untraced)
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(lambda t: t + 1 if dispatch.direct(t) else t - 1, x, check_trace=False)
    assert traced(x).equal(x - 1)
    torch._dynamo.reset()
    assert torch.compile(lambda t: t + 1 if dispatch.direct(t) else t - 1, fullgraph=True, backend="eager")(x).equal(
        x - 1)


def test_no_double_backward_through_a_direct_call():
    """The kernels' backward is not itself differentiable (nor is the custom op's): an error, not a silent zero."""
    form, args = CALLS["elu"]()
    out = form(*args)
    (dq,) = torch.autograd.grad(out.square().sum(), args[0], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


def test_a_dispatch_mode_sees_the_custom_op_not_its_body():
    q, k, v = (t.detach() for t in qkv(N=20))
    weights = ttt_weights().detach().unbind(0)  # (W1, W2, W3: as the module passes its parameters)
    with OpNames() as mode:
        fused.attention(q, k, v, None, fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False)
        fused_ttt.call_step(q, k, v, None, weights, 0.125, 0.5)
    assert mode.names == ["vitconvert.linear_attention.default", "vitconvert.ttt_step.default"], mode.names


def host_overhead():
    return load_benchmark("host_overhead")


def test_host_overhead_reports_every_layer_against_softmax(tmp_path, capsys, monkeypatch):
    import json

    argv = ["--variants", "elu,mhla,ttt", "--iters", "2", "--repeats", "1", "--json", str(tmp_path / "h.json")]
    with dispatch.kernels_on(devices=("cuda",)):  # the script switches the CPU's fused path on itself
        assert host_overhead().main(argv) == 0
        assert dispatch.current().devices == ("cuda",)  # and off again
    captured = capsys.readouterr()
    out = captured.out
    assert "timing the layers: round 1/1" in captured.err  # progress beside the table, not in it
    assert "Triton launches replaced by a counter (no GPU)" in out
    assert re.search(r"^softmax +[\d.]+ +1\.00× +[\d.]+ +1\.00× +0/0 +\d+/\d+ *$", out, re.M), out
    report = json.loads((tmp_path / "h.json").read_text())
    check_layer_rows({row["layer"]: row for row in report["rows"]})
    check_op_rows({row["op"]: row for row in report["ops"]}, out)
    assert host_overhead().main(["--variants", "nope"]) == 2
    assert host_overhead().main(["--width", "x"]) == 2
    assert host_overhead().main(["--json", str(tmp_path / "nowhere" / "h.json")]) == 2
    err = capsys.readouterr().err
    assert "error: --json" in err and "Traceback" not in err


def test_host_overhead_counts_the_split_kernels_launches(tmp_path, capsys, monkeypatch):
    """--split: heads over token ranges, as at batch 16 on an H100. ELU and InLine take 2 launches forward and 3
    backward (the state kernel's last program sums the partial states: no torch op between), counted by the
    launch counter, with the host time of each layer call."""
    import json

    argv = ["--variants", "elu,inline", "--split", "--iters", "1", "--repeats", "1", "--json", str(tmp_path / "h.json")]
    with dispatch.kernels_on(devices=("cuda",)):  # the script switches the CPU's fused path on itself
        assert host_overhead().main(argv) == 0
    assert "heads split over 2 programs" in capsys.readouterr().out
    report = json.loads((tmp_path / "h.json").read_text())
    rows = {row["layer"]: row for row in report["rows"]}
    assert report["meta"]["heads"] == "split"
    assert {name: (row["launches_infer"], row["launches_train"]) for name, row in rows.items()} == {
        "softmax": (0, 0), "elu": (2, 5), "inline": (2, 5)}
    assert all(row["infer_us"] > 0 and row["train_us"] > 0 for row in rows.values())


def check_layer_rows(rows: dict) -> None:
    """host_overhead's layer rows: launches per call of each variant, host times, and the bodies' aten ops."""
    assert list(rows) == ["softmax", "elu", "mhla", "ttt"]
    assert (rows["elu"]["launches_infer"], rows["elu"]["launches_train"]) == (1, 2)  # one kernel each way
    # MHLA at 17 tokens: the pairwise form, one kernel forward (q's and k's 1/rms, LePE in its epilogue), one
    # backward (a program per batch·head: dq, dk, dv, the norms' and LePE's backward)
    assert (rows["mhla"]["launches_infer"], rows["mhla"]["launches_train"]) == (1, 2)
    # TTT: the step in one kernel (the keys' statistics taken first, the key norm and both convs applied as it loads
    # its tiles); backward one kernel (W' recomputed, the convs' backward last)
    assert (rows["ttt"]["launches_infer"], rows["ttt"]["launches_train"]) == (1, 2)
    assert all(row["infer_us"] > 0 and row["train_us"] > 0 for row in rows.values())
    assert rows["elu"]["aten_ops_train"] > rows["elu"]["aten_ops_infer"] > 0  # the bodies' ops are counted


def check_op_rows(ops: dict, out: str) -> None:
    """host_overhead's op rows: SDPA and each op, eager and as a custom op, against SDPA."""
    assert list(ops) == ["sdpa", "linear_attention", "linear_attention (custom op)", "blocked_attention",
                         "blocked_attention (custom op)", "pairwise_attention", "pairwise_attention (custom op)"]
    assert ops["sdpa"]["infer_vs_sdpa"] == 1.0 and all(row["train_us"] > 0 for row in ops.values())
    assert re.search(r"^linear_attention \(custom op\) +[\d.]+ +[\d.]+× +[\d.]+ +[\d.]+×$", out, re.M), out


@pytest.mark.parametrize("name", ["elu", "mhla-pairwise", "mhla-blocked", "ttt"])
def test_torch_export_records_the_fused_op_and_its_graph_runs_with_grad(name, monkeypatch):
    """torch.export (non-strict: make_fx) takes the custom op, not the direct Function; MHLA's fused LayerNorm-and-qkv
    Function, whose forward export inlines, takes its plain form there, so the graph also runs with grad on."""
    from .helpers import make_module

    form = ""
    if name.startswith("mhla-"):  # each form of MHLA's kernels
        name, form = name.split("-")
        dispatch.current().settings = dispatch.KernelSettings(form=form)
    options = {"blocks_per_side": 2} if name == "mhla" else {}
    module = make_module(name, 1, (4, 4), dim=64, heads=2, dtype=torch.float32, **options).to(DEVICE)
    x = torch.randn(2, 17, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    exported = torch.export.export(module, (x,))
    ops = [str(node.target) for node in exported.graph.nodes if "vitconvert" in str(node.target)]
    op = {"elu": ["linear_attention"], "mhla": [form + "_attention"], "ttt": ["ttt_step"]}[name]  # (MHLA: LePE in
    # the kernels of either form; TTT: the key norm and both convs in the step)
    assert ops == [f"vitconvert.{o}.default" for o in op], ops  # (TTT: the plain step, no checkpoint, under export)
    out = exported.module()(x)  # grad on, parameters that require grad
    assert torch.equal(out.detach(), module(x).detach())
