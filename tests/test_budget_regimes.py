"""benchmarks/budget.py's regimes and report blocks, without training: the re-headed transfer regime changes the
class count (so every student gets a fresh head), a report never trains a missing source teacher, and a report
into another block keeps the budget block and says what each schedule cost in CPU-seconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(SCRIPTS))
import budget  # noqa: E402  (a script beside the package, not a module of it)


def test_the_reheaded_regime_changes_the_class_count_and_shares_no_digit():
    source, target, folder = budget.TASKS["reheaded"]
    assert len(source) != len(target) and not set(source) & set(target)
    assert folder != budget.TASKS["transfer"][2]  # its own source teacher, beside the 0-4 one
    runs = budget.planned(["relu", budget.CEILING], ["paper", "head10"], [5], [0], ["reheaded"])
    assert (budget.CEILING, "paper", 5, 0, "reheaded") in runs and (budget.CEILING, "head10", 5, 0, "reheaded") \
        not in runs


def test_a_report_takes_a_missing_teachers_fingerprint_from_the_records(tmp_path, monkeypatch):
    source, target, _ = budget.TASKS["reheaded"]
    monkeypatch.setitem(budget.TASKS, "reheaded", (source, target, tmp_path / "absent"))
    records = [{"variant": "relu", "schedule": "paper", "epochs": 5, "seed": s, "regime": "reheaded",
                "teacher": teacher, "top1": 0.9} for s, teacher in ((0, "old"), (0, "new"), (1, "new"))]
    kept = budget.current(records)
    assert [r["seed"] for r in kept] == [0, 1] and {r["teacher"] for r in kept} == {"new"}
    assert not (tmp_path / "absent").exists()  # nothing was trained or written


def test_a_report_into_its_own_block_keeps_the_others_and_states_cpu_seconds(tmp_path):
    results, doc = tmp_path / "sweep.jsonl", tmp_path / "results.md"
    rows = [{"variant": v, "schedule": s, "epochs": 5, "seed": seed, "regime": "same", "teacher": "digits",
             "top1": top1, "loss": 0.3, "seconds": 20.0, "cpu_seconds": cpu}
            for v in ("elu", "relu") for seed in (0, 1)
            for s, top1, cpu in (("paper", 0.92 + seed / 100, 12.0), ("lr4", 0.96, 13.0))]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc.write_text("# Results\n\n<!-- budget:begin -->\nkept\n<!-- budget:end -->\n")
    budget.write_report(results, doc, "sweep")
    text = doc.read_text()
    assert "<!-- budget:begin -->\nkept\n<!-- budget:end -->" in text
    block = text.split("<!-- sweep:begin -->", 1)[1].split("<!-- sweep:end -->", 1)[0]
    assert "(12.0 CPU-s per run, mean of 4)" in block and "(13.0 CPU-s per run, mean of 4)" in block
    assert "| lr4 | same | 5 ep | +3.5 (2/2) | +3.5 (2/2) |" in block  # seed by seed against paper
    assert "--results benchmarks/results/sweep.jsonl --block sweep" in block
    assert (tmp_path / "results-sweep.png").stat().st_size > 0
