"""Whether a schedule beats another by the rule that makes a default (issue 38, the lead's decision).

Per variant, regime and epoch budget, the mean top-1 over the seeds both schedules ran; a mean difference smaller
than one val image (same task 297 images: 0.34 points; transfer 149: 0.67) is a tie. A candidate wins if it ties or
wins every cell, wins at least one, and its differences sum above zero. Beside each cell: the seeds where the
candidate is higher (the count the earlier rule, "higher on every seed", asked for).

    python benchmarks/budget_rule.py --results benchmarks/results/budget-crop.jsonl --candidate b32-crop1 --base b32
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget import current, read_records  # noqa: E402
from reproduce import VARIANTS  # noqa: E402

# val images of each regime's target task: one image is the smallest difference a run can show
VAL_IMAGES = {"same": 297, "transfer": 149, "reheaded": 89}


@dataclass(frozen=True)
class Cell:
    regime: str
    epochs: int
    variant: str
    base: float  # mean top-1 (%) over the paired seeds
    candidate: float
    higher: int  # seeds where the candidate is higher
    seeds: int

    @property
    def difference(self) -> float:
        return self.candidate - self.base

    @property
    def outcome(self) -> str:
        """win, tie or loss: a difference under one val image is a tie (counted in images: one image is a win)."""
        if abs(self.difference) * VAL_IMAGES[self.regime] / 100 < 1 - 1e-9:
            return "tie"
        return "win" if self.difference > 0 else "loss"


def cells(records: list[dict[str, Any]], candidate: str, base: str) -> list[Cell]:
    """Every (regime, budget, variant) both schedules ran on at least one common seed."""
    top1 = {(r["regime"], r["epochs"], r["variant"], r["schedule"], r["seed"]): 100 * r["top1"] for r in records}
    out = []
    for cell in dict.fromkeys(k[:3] for k in top1 if k[3] == candidate):
        pairs = [(top1[(*cell, base, k[4])], value) for k, value in top1.items()
                 if k[:4] == (*cell, candidate) and (*cell, base, k[4]) in top1]
        if pairs:
            out.append(Cell(*cell, statistics.mean(p[0] for p in pairs),
                            statistics.mean(p[1] for p in pairs), sum(c > b for b, c in pairs), len(pairs)))
    return sorted(out, key=lambda c: (c.epochs, c.regime, VARIANTS.index(c.variant)))


def verdict(found: list[Cell]) -> str:
    """The rule's answer in one line, with the count of wins, ties and losses and the sum of the differences."""
    count = {o: sum(c.outcome == o for c in found) for o in ("win", "tie", "loss")}
    total = sum(c.difference for c in found)
    wins = bool(found) and count["loss"] == 0 and count["win"] > 0 and total > 0
    seeds = f"higher on {sum(c.higher for c in found)} of {sum(c.seeds for c in found)} seed-cells"
    return (f"{'wins' if wins else 'does not win'}: {count['win']} cells won, {count['tie']} tied, {count['loss']} "
            f"lost, differences summing to {total:+.1f} points ({seeds})")


def render(found: list[Cell], candidate: str, base: str) -> str:
    """A row per cell: both means, the difference, the outcome and the seeds where the candidate is higher."""
    lines = [f"| budget | regime | variant | `{base}` | `{candidate}` | difference | outcome | seeds higher |",
             "|---:|---|---|---:|---:|---:|---|---:|"]
    lines += [f"| {c.epochs} ep | {c.regime} | {c.variant} | {c.base:.2f} | {c.candidate:.2f} | {c.difference:+.2f} "
              f"| {c.outcome} | {c.higher}/{c.seeds} |" for c in found]
    verdicts = [f"- {epochs} epochs: `{candidate}` {verdict([c for c in found if c.epochs == epochs])}"
                for epochs in dict.fromkeys(c.epochs for c in found)]
    return "\n".join([*lines, "", *verdicts, f"- all budgets: `{candidate}` {verdict(found)}"])


def report(results: Path, candidate: str, base: str) -> str:
    """The table and verdicts of ``candidate`` against ``base`` from a budget.py JSONL (docs/results.md's block)."""
    found = cells(current(read_records(results)), candidate, base)
    if not found:
        raise SystemExit(f"error: no seed that both {candidate} and {base} ran in {results}")
    return (f"**`{candidate}` against `{base}` by the rule** (mean val top-1 over the seeds both ran; written by "
            f"`python benchmarks/budget_rule.py --results benchmarks/results/{results.name} --candidate {candidate} "
            f"--base {base}`)\n\n" + render(found, candidate, base))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="a budget.py JSONL of runs")
    parser.add_argument("--candidate", required=True)
    parser.add_argument("--base", required=True)
    args = parser.parse_args()
    print(report(args.results, args.candidate, args.base))


if __name__ == "__main__":
    main()
