"""``vitconvert bench`` through typer's CliRunner: JSON, the table, a vitconvert folder, one-line errors."""

from __future__ import annotations

import json
import sys

import pytest
import timm
from helpers import assert_one_line_error, runner, tiny_model

from vitconvert import contention
from vitconvert.cli import app

FAST = ["--threads", "1", "--repeats", "1", "--no-pretrained"]
TWO_ROUNDS = ["--threads", "1", "--repeats", "2", "--no-pretrained", "--no-memory"]


@pytest.fixture(scope="module")
def timm_folder(tmp_path_factory):
    """One block: bench times, converts and exports every block alike, so one costs half of two and shows the same."""
    folder = tmp_path_factory.mktemp("bench") / "src"
    timm.models.save_for_hf(tiny_model("vit", depth=1), str(folder), safe_serialization=True)
    return folder


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_json_has_a_row_per_model_size_and_mode(timm_folder):
    result = invoke("bench", str(timm_folder), "--to", "elu,mhla", "--img-size", "32,48", "--train", "--json",
                    "--batch-size", "2", *FAST)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = report["results"]
    assert len(rows) == 2 * 2 * 3
    assert {(r["img_size"], r["tokens"]) for r in rows} == {(32, 17), (48, 37)}
    for r in rows:
        assert r["img_per_s"] > 0 and r["ms_per_img"] > 0 and r["batch_size"] == 2
        softmax = next(s for s in rows if s["model"] == "softmax" and s["img_size"] == r["img_size"]
                       and s["mode"] == r["mode"])
        assert r["speedup"] == pytest.approx(softmax["ms_per_img"] / r["ms_per_img"])
    assert report["arch"] == "vit_tiny_patch16_224" and report["threads"] == 1


def test_onnxruntime_backend_times_the_exported_models(timm_folder):
    """The source and one variant (every variant's export runs in ONNX Runtime in tests/test_export.py)."""
    result = invoke("bench", str(timm_folder), "--to", "elu", "--backend", "onnxruntime", "--json", *FAST)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["backend"] == "onnxruntime" and [r["model"] for r in report["results"]] == ["softmax", "elu"]
    assert all(r["img_per_s"] > 0 and r["peak_mem_mb"] is None for r in report["results"])


def test_table_and_plot(timm_folder, tmp_path):
    pytest.importorskip("matplotlib")
    result = invoke("bench", str(timm_folder), "--to", "relu", "--plot", str(tmp_path / "s.png"), *FAST)
    assert result.exit_code == 0, result.output
    assert "speedup" in result.stdout and "relu" in result.stdout and "softmax" in result.stdout
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_vitconvert_folder_benches_its_own_variant_against_its_source(timm_folder, tmp_path):
    converted = tmp_path / "m"
    assert invoke("convert", str(timm_folder), "--to", "ttt", "--out", str(converted)).exit_code == 0
    result = invoke("bench", str(converted), "--json", *FAST)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["model"] for r in report["results"]] == ["softmax", "ttt"]
    assert report["arch"] == "vit_tiny_patch16_224"


@pytest.mark.parametrize("args,text", [
    (["--to", "elu,softmax2"], "unknown variant 'softmax2'"),
    (["--img-size", "224,abc"], "positive integers"),
    (["--img-size", "0"], "positive integers"),
    (["--batch-size", "0"], "at least 1"),
    (["--threads", "0"], "at least 1"),
    (["--clock", "sundial"], "unknown clock"),
    (["--device", "tpu"], "unknown device"),
    (["--to", "elu", "--option", "colour=red"], "unknown option"),
    (["--backend", "tensorrt"], "unknown backend 'tensorrt'; valid: torch, onnxruntime"),
    (["--backend", "onnxruntime", "--train"], "inference on the CPU only"),
])
def test_bad_input_is_one_line(timm_folder, args, text):
    assert_one_line_error(invoke("bench", str(timm_folder), *args, "--repeats", "1"), text)


def test_unknown_source_is_one_line():
    assert_one_line_error(invoke("bench", "deit_smal", "--no-pretrained"), "did you mean")


def test_title_says_the_precision_and_amp_is_an_option(timm_folder):
    result = invoke("bench", str(timm_folder), "--to", "relu", "--device", "cpu", *FAST)
    assert result.exit_code == 0, result.output
    assert " in float32 " in result.stdout
    result = invoke("bench", str(timm_folder), "--to", "relu", "--device", "cpu", "--amp", "bfloat16", "--json",
                    *FAST)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["amp"] == "bfloat16"
    result = invoke("bench", str(timm_folder), "--to", "relu", "--amp", "bf17", *FAST)
    assert_one_line_error(result, "unknown autocast dtype 'bf17'")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_bench_warns_on_stderr_and_records_it_in_its_json(timm_folder, monkeypatch):
    """The command's path: a contended run keeps its numbers, says so in one stderr line and marks its JSON."""
    monkeypatch.setattr(contention, "OTHERS_CPU_LIMIT", -1.0)  # any reading counts as contended
    result = invoke("bench", str(timm_folder), "--to", "relu", *TWO_ROUNDS, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["contention"]["reliable"] is False and report["contention"]["others_cpu"] is not None
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "these timings are unreliable: other processes used" in warnings[0]
    monkeypatch.setattr(contention, "OTHERS_CPU_LIMIT", 2.0)  # nothing can exceed it
    monkeypatch.setattr(contention, "SPREAD_LIMIT", float("inf"))
    result = invoke("bench", str(timm_folder), "--to", "relu", *TWO_ROUNDS)
    assert result.exit_code == 0 and "warning:" not in result.stderr and "relu" in result.stdout
