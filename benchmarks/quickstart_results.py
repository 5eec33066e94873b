"""`vitconvert quickstart` as a user runs it, recorded: the table of docs/results.md and what the run cost.

    python benchmarks/quickstart_results.py                 # one quickstart (~190 CPU-seconds), then the table
    python benchmarks/quickstart_results.py --report-only   # the table from benchmarks/results/quickstart.json

The quickstart runs with its defaults and ``--json`` in a child process; its JSON, the wall time, the CPU time
of the process and its workers (user + system) and the machine's load go to benchmarks/results/quickstart.json,
and the table between the ``quickstart`` markers of docs/results.md is rendered from that file.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from doc_blocks import footer, measure_or_report, on_cpus, others_at_most

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "quickstart.json"
DOC = ROOT / "docs" / "results.md"
BLOCK = "quickstart"


def measure() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "vitconvert", "quickstart", "--out", str(Path(tmp) / "qs"),
                               "--json"], env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"quickstart": json.loads(done.stdout), "wall_s": round(wall, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "cpus": os.cpu_count(),
            "loadavg_1min": round(os.getloadavg()[0], 1), "date": time.strftime("%Y-%m-%d"),
            "commit": commit.stdout.strip()}


def render(record: dict[str, Any]) -> str:
    """The block: what the command does, teacher and each variant against its scratch twin, what the run cost."""
    result = record["quickstart"]
    scratch = {r["variant"]: r["top1"] for r in result["scratch"]}
    lines = [f"`vitconvert quickstart` (defaults: all five variants, `recipes/quickstart.yaml`, {result['epochs']} "
             "epochs, seed 0) converts the teacher with convert's default recipe (MLPs, embeddings, norms and head "
             "copied, attention Mimetic), distils each student (task loss + attention-output MSE), reports its "
             "last validation (the weights of its run folder), and trains a scratch twin of each (same linear "
             "architecture, every weight random, task loss only, same epochs):", "",
             "| variant | distilled student | scratch, same epochs | gain |", "|---|---:|---:|---:|",
             f"| softmax teacher | {100 * result['teacher']['top1']:.2f} | | |"]
    gains = []
    for row in result["students"]:
        twin = scratch.get(row["variant"])
        gain = "" if twin is None else f"{100 * (row['top1'] - twin):+.1f}"
        gains += [] if twin is None else [100 * (row["top1"] - twin)]
        lines.append(f"| {row['variant']} | {100 * row['top1']:.2f} | "
                     f"{'' if twin is None else f'{100 * twin:.2f}'} | {gain} |")
    beaten = sum(g > 0 for g in gains)
    # the run's own share of the cores bounds what others took: its CPU time over all the time the cores had
    where = on_cpus(record["cpus"], others_at_most(record["cpu_s"], record["wall_s"], record["cpus"]),
                    f"load average {record['loadavg_1min']} at the end")
    lines += ["", footer(f"{beaten} of {len(gains)} students beat their scratch twin, by {min(gains):.0f} to "
                         f"{max(gains):.0f} points. The run took {record['cpu_s']:.0f} CPU-seconds (user + system, "
                         f"all workers) and {record['wall_s']:.0f} s of wall time {where}, {record['date']}, commit "
                         f"{record['commit']}", "benchmarks/quickstart_results.py", str(RESULTS.relative_to(ROOT)))]
    return "\n".join(lines)


if __name__ == "__main__":
    measure_or_report(__doc__.splitlines()[0], RESULTS, measure, DOC, BLOCK, render)
