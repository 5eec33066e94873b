"""bench: sane fields, speedup = softmax ms / variant ms, FLOPs against a hand count. Nothing here times anything."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from vitconvert import bench
from vitconvert.attention import VARIANTS
from vitconvert.bench import benchmark, linear_copy, peak_memory_bytes
from vitconvert.cli.bench import parse_sizes, parse_variants, plot_speedups
from vitconvert.errors import BadValue, VitconvertError
from vitconvert.flops import flops_per_image

# The tiny ViT of conftest at 48 px: patch 8 -> 36 patches + class token, width 32, 2 heads of 16, depth 2.
N, C, D, LAYERS, CLASSES, PATCHES = 37, 32, 16, 2, 1000, 36
SHARED = 2 * PATCHES * C * 3 * 8 * 8 + LAYERS * 2 * N * C * (3 * C + C + 2 * 4 * C) + 2 * C * CLASSES


@pytest.fixture(scope="module")
def report():
    return benchmark(tiny_model("vit", img_size=48), ["elu", "ttt"], batch_size=2, train=True, repeats=2,
                     threads=1)


def test_rows_have_sane_fields(report):
    assert [(r.model, r.mode) for r in report.rows] == [
        (m, mode) for mode in ("infer", "train") for m in ("softmax", "elu", "ttt")]
    for row in report.rows:
        assert row.img_size == 48 and row.tokens == N and row.batch_size == 2
        assert row.ms_per_img > 0 and row.img_per_s > 0 and row.peak_mem_mb > 0
        assert len(row.times_ms) == 2
    assert report.threads == 1 and report.device == "cpu"


def test_medians_speedups_and_turns_against_a_fake_clock(monkeypatch):
    """Scripted step durations on a fake clock: ms/img is the median over rounds per image, img/s its inverse,
    speedup the ratio of medians, and the models take turns in alternating order (no model always runs right
    after the same other one)."""
    clock = {"now": 0.0}
    durations = {"softmax": [0.010, 0.030, 0.020], "elu": [0.004, 0.100, 0.005]}  # elu: one outlier round
    calls: list[str] = []

    def step(name: str):
        def run() -> None:
            calls.append(name)
            clock["now"] += durations[name][sum(c == name for c in calls) - 1]
        return run

    monkeypatch.setitem(bench.CLOCKS, "wall", lambda: clock["now"])
    times = bench.take_turns({"softmax": step("softmax"), "elu": step("elu")}, torch.device("cpu"), repeats=3,
                             warmup=0)
    rows = {r.model: r for r in bench.rows_of(times, {"softmax": None, "elu": None}, {"softmax": 1.0, "elu": 1.0},
                                              mode="infer", img_size=8, tokens=5, batch=2)}  # ms per image: half
    assert calls == ["softmax", "elu", "elu", "softmax", "softmax", "elu"]
    assert rows["softmax"].ms_per_img == pytest.approx(20 / 2) and rows["elu"].ms_per_img == pytest.approx(5 / 2)
    assert rows["softmax"].img_per_s == pytest.approx(100) and rows["elu"].img_per_s == pytest.approx(400)
    assert rows["elu"].speedup == pytest.approx(4.0) and rows["softmax"].speedup == 1.0  # the median ignores 100 ms
    assert rows["elu"].times_ms == pytest.approx([4.0, 100.0, 5.0])  # per step, in turn order


def test_flop_bound_matches_a_hand_count(report):
    """Softmax: shared + 4·N²·C per layer; ELU: shared + φ(K)ᵀ[V|1] and φ(Q)·[S|z], 2·N·C·(d+1) each."""
    softmax = SHARED + LAYERS * 4 * N * N * C
    elu = SHARED + LAYERS * 4 * N * C * (D + 1)
    rows = {r.model: r for r in report.rows if r.mode == "infer"}
    assert rows["softmax"].gflops_per_img * 1e9 == pytest.approx(softmax)
    assert rows["elu"].gflops_per_img * 1e9 == pytest.approx(elu)
    assert rows["elu"].flop_bound == pytest.approx(softmax / elu)
    assert rows["ttt"].flop_bound < rows["elu"].flop_bound  # its inner step costs more than a kernel readout


def test_flops_count_per_image_whatever_the_batch():
    model = tiny_model("vit", img_size=48)
    one = flops_per_image(model, torch.randn(1, 3, 48, 48))
    assert flops_per_image(model, torch.randn(3, 3, 48, 48)) == pytest.approx(one)
    assert flops_per_image(linear_copy(model, "relu"), torch.randn(1, 3, 48, 48)) < one


def test_other_image_sizes_rebuild_the_source():
    report = benchmark(tiny_model("vit"), ["relu"], img_sizes=[32, 64], repeats=1, threads=1)
    assert [(r.img_size, r.tokens) for r in report.rows] == [(32, 17), (32, 17), (64, 65), (64, 65)]


def test_cpu_clock_and_no_memory():
    report = benchmark(tiny_model("vit"), ["relu"], repeats=1, threads=1, clock="cpu", memory=False)
    assert report.clock == "cpu" and all(r.peak_mem_mb is None and r.ms_per_img > 0 for r in report.rows)
    with pytest.raises(VitconvertError, match="unknown clock"):
        benchmark(tiny_model("vit"), ["relu"], clock="sundial")


def test_threads_are_restored():
    before = torch.get_num_threads()
    benchmark(tiny_model("vit"), ["relu"], repeats=1, threads=1)
    assert torch.get_num_threads() == before


def test_peak_memory_sees_cpu_tensors():
    kept = []

    def step() -> None:
        kept.append(torch.ones(2**20, dtype=torch.uint8))  # 1 MiB, alive at the end
        torch.ones(3 * 2**20, dtype=torch.uint8)  # 3 MiB, freed at once: only the peak sees it

    peak = peak_memory_bytes(step, torch.device("cpu"))
    assert 4 * 2**20 <= peak < 5 * 2**20


FIRST, SECOND = list(VARIANTS)[:2]


@pytest.mark.parametrize("text,expected", [(FIRST, [FIRST]), (f" {FIRST}, {SECOND} ,{FIRST}", [FIRST, SECOND]),
                                           (None, None)])
def test_parse_variants(text, expected):
    assert parse_variants(text) == expected


@pytest.mark.parametrize("text,message", [("softmax", "unknown variant 'softmax'"), (",", "at least one")])
def test_parse_variants_errors(text, message):
    with pytest.raises(BadValue, match=message) as e:
        parse_variants(text)
    assert e.value.name == "to"  # the CLI says --to


def test_parse_sizes():
    assert parse_sizes("224, 512,224") == [224, 512]
    for bad in ("224,abc", "0", "-32", "224,,512", "2.5"):
        with pytest.raises(VitconvertError, match="positive integers"):
            parse_sizes(bad)


def test_bad_arguments():
    model = tiny_model("vit")
    with pytest.raises(VitconvertError, match="at least 1"):
        benchmark(model, ["elu"], batch_size=0)
    with pytest.raises(BadValue, match="unknown variant") as e:
        benchmark(model, ["softmax"])
    assert e.value.name == "variants"


def test_plot_writes_png(report, tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_speedups(report, tmp_path / "speed.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_each_variant_per_mode_and_its_flop_bound_once(report):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from vitconvert.cli.bench import _plot_curves

    ax = Figure().subplots()
    _plot_curves(ax, report.rows)
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert len(ax.get_lines()) == 6  # two variants × (infer, train, bound)
    assert sorted(lines) == ["FLOP bound", "elu (infer)", "elu (train)", "ttt (infer)", "ttt (train)"]  # one bound
    assert lines["elu (infer)"].get_linestyle() == "-" and lines["elu (train)"].get_linestyle() == ":"
    assert lines["FLOP bound"].get_linestyle() == "--"
    elu = {r.mode: r.speedup for r in report.rows if r.model == "elu"}
    assert list(lines["elu (train)"].get_ydata()) == [elu["train"]]


def test_plot_without_matplotlib_is_one_clear_error(report, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(VitconvertError, match=r"pip install 'vitconvert\[plot\]'"):
        plot_speedups(report, tmp_path / "speed.png")


def test_amp_runs_the_forward_under_autocast_and_plain_runs_stay_float32():
    from vitconvert.bench import make_step

    model = tiny_model("vit", img_size=32)
    seen = []
    model.head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    x = torch.randn(1, 3, 32, 32)
    for mode in ("infer", "train"):
        make_step(model, x, mode, amp="bfloat16")()
        make_step(model, x, mode)()
    assert seen == [torch.bfloat16, torch.float32] * 2


def test_compile_runs_every_model_through_the_named_backend_and_records_it():
    from torch._dynamo import register_backend

    graphs = []

    @register_backend
    def vitconvert_test_counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    report = benchmark(tiny_model("vit", img_size=32), [FIRST, SECOND], repeats=1, warmup=0, train=True,
                       threads=1, memory=False, amp="bfloat16", compile="vitconvert_test_counting")
    assert report.compile == "vitconvert_test_counting" and report.amp == "bfloat16"
    assert report.to_dict()["compile"] == "vitconvert_test_counting"
    assert len(graphs) >= 3 * 2  # each of the three models, in inference and in training
    assert len(report.rows) == 6 and all(r.img_per_s > 0 for r in report.rows)


def test_unknown_autocast_dtype_is_a_user_error():
    with pytest.raises(VitconvertError, match="unknown autocast dtype 'bf17'"):
        benchmark(tiny_model("vit", img_size=32), ["elu"], amp="bf17")


@pytest.mark.parametrize(("warmup", "mode", "amp", "compile", "rounds"), [
    (1, "infer", None, None, 0),  # counting FLOPs was the warm-up of a plain inference
    (1, "train", None, None, 1),
    (1, "infer", "bfloat16", None, 1),  # FLOPs are counted in float32: bf16 kernels are still cold
    (0, "infer", None, "inductor", 1),  # a compiled model compiles in its first call, never in a timed one
])
def test_warmup_rounds(warmup, mode, amp, compile, rounds):
    from vitconvert.bench import warmup_rounds

    assert warmup_rounds(warmup, mode, amp, compile) == rounds


@pytest.mark.parametrize(("amp", "device", "backend", "resolved"), [
    ("auto", "cuda", "torch", "bfloat16"),  # GPUs: bf16, as ViTs are trained and served there
    ("auto", "cuda:1", "torch", "bfloat16"),
    ("auto", "cpu", "torch", None),
    ("auto", "cpu", "onnxruntime", None),
    ("none", "cuda", "torch", None),
    ("float32", "cuda", "torch", None),
    (None, "cuda", "torch", None),
    ("float16", "cpu", "torch", "float16"),
])
def test_auto_autocast_is_bf16_on_cuda_only(amp, device, backend, resolved):
    from vitconvert.bench_config import resolve_amp

    assert resolve_amp(amp, device, backend) == resolved


def test_default_run_on_the_cpu_records_float32():
    report = benchmark(tiny_model("vit", img_size=32), ["elu"], repeats=1, warmup=0, threads=1, memory=False,
                       device="cpu")
    assert report.amp is None
