"""Issue 37's targets without a GPU, at its own size (4097 tokens): one table, each number against its target.

    python benchmarks/proxy_targets.py                  # count all four (~30 CPU-minutes), then write the block
    python benchmarks/proxy_targets.py --skip-batch16   # batch 1 and memory only (~7 CPU-minutes)
    python benchmarks/proxy_targets.py --report-only    # the block from the results files, nothing counted

vit_small_patch16_224 built at 1024 px (64×64 patches and the class token), one block: the token mixing's q-sized
passes per layer training step and its launches and torch ops (benchmarks/op_traffic.py --passes --sizes-only), and
what autograd keeps and the largest tensor one op writes (benchmarks/saved_memory.py --sizes-only), each variant
against softmax, with heads split over token ranges as on an H100 or H200 (``--programs 528``); the passes also with
one program per head (the CPU's plan, which the 224 px tables count). The targets: MHLA ≤ 12 passes, TTT ≤ 7; a
linear variant's mixing ≤ 2 launches forward and 3 backward with no torch op; kept and largest transient ≤
softmax's. The block is ``proxy-targets-4097`` of docs/performance.md; benchmarks/doc_tables.py renders it again
from the same files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from doc_blocks import footer, write_block

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC, BLOCK = ROOT / "docs" / "performance.md", "proxy-targets-4097"
PASSES, BATCHED, MEMORY = "op-traffic-passes-1024.json", "op-traffic-passes-1024-b16.json", "saved-memory-1024.json"
UNSPLIT = "op-traffic-passes-1024-unsplit.json"
GPU_PROGRAMS = 4 * 132  # programs a launch wants on an H100 or H200 (132 SMs) before heads split over token ranges
BATCHED_VARIANTS = "elu,mhla,ttt"  # (relu and inline run ELU's kernels on the same tensors: 224 px, one image)
COMMANDS = {
    PASSES: f"benchmarks/op_traffic.py --passes --depth 1 --batch 1 --img-size 1024 --sizes-only --programs "
            f"{GPU_PROGRAMS} --json benchmarks/results/{PASSES}",
    UNSPLIT: f"benchmarks/op_traffic.py --passes --depth 1 --batch 1 --img-size 1024 --sizes-only --json "
             f"benchmarks/results/{UNSPLIT}",
    BATCHED: f"benchmarks/op_traffic.py --passes --depth 1 --batch 16 --img-size 1024 --variants {BATCHED_VARIANTS} "
             f"--sizes-only --programs {GPU_PROGRAMS} --json benchmarks/results/{BATCHED}",
    MEMORY: f"benchmarks/saved_memory.py --depth 1 --batch 1 --img-size 1024 --sizes-only --programs {GPU_PROGRAMS} "
            f"--json benchmarks/results/{MEMORY}",
}
PASS_TARGETS = {"mhla": 12, "ttt": 7}
LAUNCH_TARGET = (2, 3)  # forward, backward; and no torch op in the mixing


def pass_miss(name: str, counts: list[tuple[float, str]]) -> Optional[str]:
    """How far ``name``'s pass counts (each with where it was counted) are over its target; None if none is."""
    target = PASS_TARGETS[name]
    return ", ".join(f"{value - target:.1f} over{where}" for value, where in counts if value > target) or None


def launch_miss(launches: dict[str, float], torch_ops: dict[str, float]) -> Optional[str]:
    """What of a linear variant's mixing is beyond ≤ 2 + 3 launches with no torch op; None if nothing."""
    runs, ops = (launches["forward"], launches["backward"]), torch_ops["forward"] + torch_ops["backward"]
    misses = [f"{runs[0]:.0f} + {runs[1]:.0f} launches"] if runs[0] > LAUNCH_TARGET[0] or runs[1] > LAUNCH_TARGET[1] \
        else []
    return ", ".join(misses + ([f"{ops:.0f} torch ops"] if ops else [])) or None


def memory_miss(row: dict[str, Any], softmax: dict[str, Any]) -> Optional[str]:
    """Which of kept-for-backward and largest transient is above softmax's, by what ratio; None if neither."""
    ratios = [(what, row[key] / softmax[key]) for what, key in (("kept", "saved_mib"),
                                                                ("largest", "largest_transient_mib"))]
    return ", ".join(f"{what} {ratio:.2f}×" for what, ratio in ratios if ratio > 1) or None


def verdict(miss: Optional[str], prefix: str = "") -> str:
    return prefix + ("holds" if miss is None else f"misses, {miss}")


@dataclass(frozen=True)
class Counts:
    """The results files: op_traffic.py --passes tables (one image as a GPU splits heads; ``batched``: batch 16;
    ``unsplit``: one program per head) and saved_memory.py's; the optional ones None where not counted."""
    now: dict[str, Any]
    memory: dict[str, Any]
    batched: Optional[dict[str, Any]] = None
    unsplit: Optional[dict[str, Any]] = None

    def passes(self, which: str) -> dict[str, float]:
        found = getattr(self, which)
        return found["q_sized_passes"] if found else {}

    def pass_counts(self, name: str) -> list[tuple[float, str]]:
        """``name``'s passes as a GPU splits heads: one image, and batch 16 where counted."""
        wide = self.passes("batched")
        return [(self.now["q_sized_passes"][name], "")] + ([(wide[name], " at batch 16")] if name in wide else [])


def _ratio(passes: dict[str, float], name: str) -> str:
    return f"{passes[name]:.1f} ({passes[name] / passes['softmax']:.2f}×)" if name in passes else "—"


def table(counts: Counts) -> list[str]:
    """The header and one row per variant, each number beside its target's verdict."""
    now, memory = counts.now, counts.memory["variants"]
    soft = memory.get("softmax")
    lines = ["| variant | q-sized passes (× softmax) | at batch 16 | one program per head | passes: MHLA ≤ 12, TTT ≤ 7 "
             "| launches, forward + backward | torch ops, forward + backward | token-sized ops and launches | "
             "launches: ≤ 2 + 3, no torch op | kept for backward × softmax | largest transient × softmax | memory: "
             "≤ softmax's |", "|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---|"]
    for name in now["q_sized_passes"]:
        runs, ops, kept = now["launches"][name], now["torch_ops"][name], memory.get(name)
        cells = [_ratio(counts.passes(which), name) for which in ("now", "batched", "unsplit")]
        cells += [verdict(pass_miss(name, counts.pass_counts(name)), f"≤ {PASS_TARGETS[name]}: ")
                  if name in PASS_TARGETS else "—",
                  f"{runs['forward']:.0f} + {runs['backward']:.0f}", f"{ops['forward']:.0f} + {ops['backward']:.0f}",
                  f"{now['token_sized_ops'][name]:.0f}", "—" if name == "softmax" else verdict(launch_miss(runs, ops))]
        cells += ["—", "—", "—"] if not (kept and soft) else [
            f"{kept['saved_mib'] / soft['saved_mib']:.2f}×",
            f"{kept['largest_transient_mib'] / soft['largest_transient_mib']:.2f}×",
            "—" if name == "softmax" else verdict(memory_miss(kept, soft))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _passes_held(counts: Counts) -> tuple[list[str], list[str]]:
    held, missed = [], []
    for name in (n for n in PASS_TARGETS if n in counts.now["q_sized_passes"]):
        found = counts.pass_counts(name)
        unsplit = counts.passes("unsplit").get(name)
        others = [f"{value:.1f}{where}" for value, where in found[1:]] \
            + ([f"{unsplit:.1f} with one program per head"] if unsplit else [])
        text = f"{name}'s passes, {found[0][0]:.1f}" + (f" ({'; '.join(others)})" if others else "") \
            + f" against ≤ {PASS_TARGETS[name]}"
        miss = pass_miss(name, found)
        (held if miss is None else missed).append(text + ("" if miss is None else f": {miss}"))
    return held, missed


def _launches_held(counts: Counts, linear: list[str]) -> tuple[list[str], list[str]]:
    misses = {name: launch_miss(counts.now["launches"][name], counts.now["torch_ops"][name]) for name in linear}
    fine = [name for name in linear if misses[name] is None]
    return ([f"{', '.join(fine)}: ≤ {LAUNCH_TARGET[0]} launches forward and {LAUNCH_TARGET[1]} backward, no torch op "
             "in the mixing"] if fine else [],
            [f"{name}'s launches: {misses[name]}" for name in linear if name not in fine])


def _memory_held(memory: dict[str, Any], linear: list[str]) -> tuple[list[str], list[str]]:
    misses = {name: memory_miss(memory[name], memory["softmax"]) for name in linear if name in memory}
    fine = [name for name, miss in misses.items() if miss is None]
    return ([("every variant's" if len(fine) == len(linear) else ", ".join(fine) + ":") + " bytes kept for backward "
             "and largest transient ≤ softmax's"] if fine else [],
            [f"{name}'s memory: {miss}" for name, miss in misses.items() if miss is not None])


def summary(counts: Counts) -> str:
    """One sentence each: which of the targets hold, which do not and by how much."""
    linear = [name for name in counts.now["q_sized_passes"] if name != "softmax"]
    memory = counts.memory["variants"]
    verdicts = [_passes_held(counts), _launches_held(counts, linear), _memory_held(memory, linear)]
    held, missed = ([text for verdict in verdicts for text in verdict[side]] for side in (0, 1))
    unmeasured = [name for name in linear if name not in memory]
    return (f"At {counts.now['tokens']} tokens these targets hold: {'; '.join(held) or 'none'}. These do not: "
            f"{'; '.join(missed) or 'none'}." + (f" Memory not measured for {', '.join(unmeasured)}." if unmeasured
                                                 else ""))


def render(counts: Counts) -> str:
    """The block: the table, the summary, and how it was counted (the commands that wrote its files)."""
    now, batched = counts.now, counts.batched
    files = [PASSES] + [f for f, found in ((BATCHED, batched), (UNSPLIT, counts.unsplit)) if found] + [MEMORY]
    cpu = " and ".join(f"{found['cpu_s']:.0f}" for found in (now, batched, counts.unsplit) if found)
    how = (f"{now['model']} at {now['img_size']} px ({now['tokens']} tokens), {now['depth']} block, batch "
           f"{now['batch']}" + (f" (passes also at batch {batched['batch']})" if batched else "")
           + (f", heads split over token ranges as for {now['programs']} programs (an H100's or H200's 132 SMs × 4)"
              if now.get("programs") else ", one program per head") + ", one bf16 training step on the GPU path, "
           "each Triton launch's tensor arguments counted and the kernels not run (no GPU); the pass counts took "
           f"{cpu} CPU-s")
    return "\n".join(table(counts) + ["", summary(counts), "", footer(how, [COMMANDS[f] for f in files],
                                                                       "benchmarks/results/" + ", ".join(files))])


def read() -> Counts:
    """The results files (the batch-16 and one-program ones where they are)."""
    found = {name: json.loads((RESULTS / name).read_text()) if (RESULTS / name).is_file() else None
             for name in (PASSES, MEMORY, BATCHED, UNSPLIT)}
    return Counts(found[PASSES], found[MEMORY], found[BATCHED], found[UNSPLIT])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="only rebuild the block from the results files")
    parser.add_argument("--skip-batch16", action="store_true",
                        help="count batch 1 and memory only; the batch-16 file is removed, not left stale")
    args = parser.parse_args(argv)
    if not args.report_only:
        for name, command in COMMANDS.items():
            if name == BATCHED and args.skip_batch16:
                (RESULTS / BATCHED).unlink(missing_ok=True)
                continue
            print(f"running python {command}", file=sys.stderr, flush=True)  # (the batch-16 count: ~20 minutes)
            if subprocess.run([sys.executable, *command.split()], cwd=ROOT).returncode:
                print(f"error: python {command} failed; the block is left as it was", file=sys.stderr)
                return 1
    missing = [name for name in (PASSES, MEMORY) if not (RESULTS / name).is_file()]
    if missing:
        print(f"error: benchmarks/results/{missing[0]} is missing: run python {COMMANDS[missing[0]]}", file=sys.stderr)
        return 1
    write_block(DOC, BLOCK, render(read()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
