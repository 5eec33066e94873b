"""benchmarks/budget.py end to end: one variant, one 1-epoch budget, one seed on the digits; the run is recorded,
a rerun skips it, and the table lands between the budget markers without touching the rest. The runs, the rerun
and the refusal of a wrong flag call the script's main() in this process, with the command line a shell gives
it; the training itself runs in the sweep's worker process, spawned as when the script runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "budget.py"


def argv(tmp_path: Path, *extra: str) -> list[str]:
    return [str(SCRIPT), "--variants", "relu", "--schedules", "paper", "--epochs", "1", "--seeds", "0", "--regimes",
            "same", "--results", str(tmp_path / "budget.jsonl"), "--doc", str(tmp_path / "results.md"), *extra]


def budget_here(tmp_path: Path, monkeypatch, *extra: str) -> None:
    """The script's main() in this process, with the command line ``budget`` gives it."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import budget as script

    monkeypatch.setattr(sys, "argv", argv(tmp_path, *extra))
    script.main()


def test_one_run_is_recorded_reported_and_not_repeated(tmp_path, monkeypatch, capsys):
    (tmp_path / "results.md").write_text("# Results\n\nprose above\n")
    budget_here(tmp_path, monkeypatch)
    assert "1 runs to do (0 already recorded)" in capsys.readouterr().out
    [record] = [json.loads(line) for line in (tmp_path / "budget.jsonl").read_text().splitlines()]
    assert (record["variant"], record["schedule"], record["epochs"], record["seed"], record["regime"]) == (
        "relu", "paper", 1, 0, "same")
    assert 0.0 <= record["top1"] <= 1.0 and record["seconds"] > 0
    text = (tmp_path / "results.md").read_text()
    assert text.startswith("# Results\n\nprose above\n")
    block = text.split("<!-- budget:begin -->", 1)[1].split("<!-- budget:end -->", 1)[0]
    assert f"| paper | relu | {100 * record['top1']:.1f} (1) |" in block
    assert (tmp_path / "results-budget.png").stat().st_size > 0

    budget_here(tmp_path, monkeypatch)  # resumable: the recorded run is skipped, the report rewritten in place
    assert "0 runs to do (1 already recorded)" in capsys.readouterr().out
    assert len((tmp_path / "budget.jsonl").read_text().splitlines()) == 1
    assert (tmp_path / "results.md").read_text().count("<!-- budget:begin -->") == 1


def test_an_unknown_schedule_is_one_line_and_exit_nonzero(tmp_path, monkeypatch):
    """SystemExit with a message: a process prints it as one line on stderr and exits 1."""
    with pytest.raises(SystemExit) as stopped:
        budget_here(tmp_path, monkeypatch, "--schedules", "warp")
    message = stopped.value.code
    assert isinstance(message, str) and "unknown schedule warp" in message and "\n" not in message
    assert not (tmp_path / "budget.jsonl").exists()


def test_the_softmax_ceiling_is_planned_in_transfer_with_the_paper_schedule_only():
    sys.path.insert(0, str(SCRIPT.parent))
    from budget import CEILING, planned

    runs = planned(["relu", CEILING], ["paper", "new10"], [2], [0], ["same", "transfer"])
    assert [r for r in runs if r[0] == CEILING] == [(CEILING, "paper", 2, 0, "transfer")]
    assert len(runs) == 5  # relu: 2 schedules × 2 regimes


def test_the_softmax_ceiling_trains_the_softmax_model_by_the_recipe():
    sys.path.insert(0, str(SCRIPT.parent))
    from softmax_ceiling import finetune_softmax

    metrics = finetune_softmax("digits", {"epochs": 1, "seed": 0, "batch_size": 256}, None)
    assert 0.5 < metrics["top1"] <= 1.0 and metrics["n"] == 297  # the trained teacher stays a good model
    again = finetune_softmax("digits", {"epochs": 1, "seed": 0, "batch_size": 256}, None)
    assert again["top1"] == metrics["top1"] and again["loss"] == metrics["loss"]  # seeded: the same run twice


def test_a_derived_schedule_is_paired_with_its_base_seed_by_seed():
    sys.path.insert(0, str(SCRIPT.parent))
    from budget import verdict_table
    from budget_schedules import SCHEDULES

    def rec(schedule, seed, top1):
        return {"variant": "elu", "schedule": schedule, "epochs": 2, "seed": seed, "regime": "same", "top1": top1}

    records = [rec("paper", 0, 0.5), rec("paper", 1, 0.6), rec("b32", 0, 0.8), rec("b32", 1, 0.7),
               rec("b32-tf10", 0, 0.9), rec("b32-tf10", 1, 0.6), rec("b16", 0, 0.85), rec("b16", 1, 0.75)]
    assert "| b32 | same | 2 ep | +20.0 (2/2) |" in verdict_table(records)
    against_b32 = verdict_table(records, "b32")
    assert "| b32-tf10 | same | 2 ep | +0.0 (1/2) |" in against_b32 and "| paper |" not in against_b32
    assert "| b16 | same | 2 ep | +5.0 (2/2) |" in against_b32  # not named b32-*, derived from it (DERIVED_FROM)
    assert SCHEDULES["b8-sqrt"][1](2, "same") == {"batch_size": 8, "lr": 1e-3}  # 2e-3 × √(8/32)
    # a tenth of the run's optimizer steps at batch 32 (46 an epoch in the same task, 23 in transfer)
    assert SCHEDULES["b32-tf10"][1](5, "same")["stages"] == "attn:23steps,finetune"
    assert SCHEDULES["b32-tf10"][1](2, "transfer")["stages"] == "attn:5steps,finetune"
