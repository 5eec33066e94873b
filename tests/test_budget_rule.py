"""benchmarks/budget_rule.py: the rule that makes a schedule a default, on hand-made records whose counts of val
images are known (one same-task image is 100/297 points, one transfer image 100/149)."""

from __future__ import annotations

from tests.helpers import load_benchmark


def _runs(schedule: str, regime: str, variant: str, correct: list[int]) -> list[dict]:
    images = {"same": 297, "transfer": 149}[regime]
    return [{"variant": variant, "schedule": schedule, "epochs": 6, "seed": seed, "regime": regime,
             "top1": n / images} for seed, n in enumerate(correct)]


def test_one_image_on_the_mean_wins_and_less_ties():
    rule = load_benchmark("budget_rule")
    records = (_runs("base", "same", "elu", [290, 290, 290]) + _runs("new", "same", "elu", [291, 291, 291])
               + _runs("base", "transfer", "elu", [140, 140, 140]) + _runs("new", "transfer", "elu", [142, 140, 139]))
    same, transfer = rule.cells(records, "new", "base")
    assert (same.outcome, same.higher, same.seeds) == ("win", 3, 3)
    assert (transfer.outcome, transfer.higher) == ("tie", 1)  # +1/3 image on the mean
    assert rule.verdict([same, transfer]).startswith("wins: 1 cells won, 1 tied, 0 lost")


def test_a_lost_cell_loses_whatever_the_sum():
    rule = load_benchmark("budget_rule")
    records = (_runs("base", "same", "elu", [280, 280]) + _runs("new", "same", "elu", [297, 297])
               + _runs("base", "same", "mhla", [295, 295]) + _runs("new", "same", "mhla", [294, 294, 200]))
    found = rule.cells(records, "new", "base")
    assert [c.outcome for c in found] == ["win", "loss"]  # mhla's third seed has no pair: left out
    assert found[1].seeds == 2
    assert rule.verdict(found).startswith("does not win: 1 cells won, 0 tied, 1 lost")
