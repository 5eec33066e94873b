"""benchmarks/probe_kernels.py runs end to end on a CPU (eager rows, no graphs) and writes every row as it goes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_kernels", ROOT / "benchmarks" / "probe_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_section_writes_its_rows_on_a_cpu(probe, tmp_path):
    out = tmp_path / "probe.jsonl"
    assert probe.main(["--device", "cpu", "--quick", "--out", str(out), "--budget-s", "600"]) == 0
    found = rows(out)
    assert [r["section"] for r in found][0] == "environment" and found[-1]["section"] == "done"
    by = {s: [r for r in found if r["section"] == s] for s in probe.SECTIONS}
    assert len(by["ceiling"]) == 1 and by["ceiling"][0]["gb_s"] > 0
    plan = probe.QUICK
    models = {r["model"] for r in by["layers"]}
    assert {"softmax", "elu", "relu", "inline", "mhla", "ttt"} <= models
    assert {(r["batch"], r["tokens"]) for r in by["layers"]} == set(plan.shapes)
    for r in by["layers"] + by["tiles"]:
        assert "error" not in r, r
        assert r["gpu_ms"] is None and r["host_ms"] > 0 and r["bytes"] > 0  # no CUDA graphs on a CPU
    assert {r["config"] for r in by["tiles"]} == set(plan.tile_settings)
    assert {r["model"] for r in by["top"]} == models
    assert all(r["kernels"] and r["kernels"][0]["us"] > 0 for r in by["top"])
    assert [r["section"] for r in found][1] == "parity"  # (first: φ on bf16 pairs, then the kernels vs float32)
    assert_parity_rows(by["parity"])


def assert_parity_rows(parity: list[dict]) -> None:
    """φ on bf16 pairs unchecked (no PTX on a CPU), and each variant on each path: eager bf16 against float32."""
    pairs = [r for r in parity if r["check"] == "φ on bf16 pairs"]
    assert {r["model"] for r in pairs} == {"elu", "relu"} and all(r["mismatches"] is None for r in pairs)
    mixing = [r for r in parity if r["check"] == "bf16 kernels vs float32"]
    assert {(r["model"], r["path"]) for r in mixing} == {(m, p) for m in ("elu", "relu", "inline")
                                                        for p in ("one launch", "split")}
    for r in mixing:  # (a CPU runs the eager forms: bf16 against float32, within bf16's rounding)
        assert r["verdict"] == "eager (no GPU)" and 0 < r["output_error"] < 1e-2 and 0 < r["grad_error"] < 1e-2, r


def test_rows_past_the_budget_are_recorded_as_skipped(probe, tmp_path):
    out = tmp_path / "probe.jsonl"
    assert probe.main(["--device", "cpu", "--quick", "--out", str(out), "--budget-s", "0",
                       "--sections", "layers,tiles"]) == 0
    found = [r for r in rows(out) if r["section"] in ("layers", "tiles")]
    assert found and all(r.get("skipped") == "budget" for r in found)


def test_an_unknown_section_is_a_parser_error(probe, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        probe.main(["--device", "cpu", "--quick", "--sections", "nope", "--out", str(tmp_path / "p.jsonl")])
    assert stop.value.code == 2 and "unknown section(s) nope" in capsys.readouterr().err
