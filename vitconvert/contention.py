"""Whether a benchmark's times can be trusted: other work on its CPUs, and how much its rounds disagree.

Why: models take turns, so a steady load slows them alike, but a load that comes and goes does not, and on a
busy 2-core machine the same ``bench`` command gave 4.95×, 1.00× and 0.71× with no word. Two signals, both
measured in the run itself:

- **others' CPU**: the kernel's busy time on the CPUs this process may run on (``/proc/stat``), less this
  process's own CPU time, over the wall time × those CPUs: the share other processes took while we timed.
  Linux only; elsewhere it is unknown (None).
- **spread**: each round times every model once, so softmax's time over a variant's in the same round is one
  speedup per round; (max − min) / median of those is how much the answer moved between rounds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

OTHERS_CPU_LIMIT = 0.25  # other processes took more than a quarter of our CPUs' time
SPREAD_LIMIT = 0.25  # a variant's per-round speedups differ by more than a quarter of their median


@dataclass
class CpuSample:
    wall: float  # seconds, a monotonic clock
    busy: Optional[float]  # seconds our CPUs were busy (any process), None where unreadable
    ours: float  # this process's CPU seconds (every thread)


def busy_seconds(cpus: Optional[set[int]] = None, stat: str = "/proc/stat") -> Optional[float]:
    """Busy seconds of ``cpus`` (default: those this process may run on) since boot, from the kernel's
    per-CPU counters (user, nice, system, irq, softirq, steal; guest time is already in user)."""
    try:
        with open(stat) as fh:
            lines = fh.read().splitlines()
        allowed = cpus if cpus is not None else os.sched_getaffinity(0)
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError):
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in allowed and len(fields) >= 8:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total / tick if total else None


def sample() -> CpuSample:
    """Wall time, the whole machine's busy CPU time and this process's CPU time, read together."""
    times = os.times()
    return CpuSample(time.perf_counter(), busy_seconds(), times.user + times.system)


def others_share(start: CpuSample, end: CpuSample, cpus: Optional[int] = None) -> Optional[float]:
    """The share (0–1) of our CPUs' time that other processes used between two samples."""
    wall = end.wall - start.wall
    if start.busy is None or end.busy is None or wall <= 0:
        return None
    count = cpus if cpus is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    others = (end.busy - start.busy) - (end.ours - start.ours)
    return min(max(others / (wall * count), 0.0), 1.0)


def speedup_spread(reference: Sequence[float], times: Sequence[float]) -> float:
    """(max − min) / median of the per-round speedups ``reference[r] / times[r]`` (0 with fewer than 2 rounds)."""
    ratios = [a / b for a, b in zip(reference, times, strict=True) if b > 0]
    if len(ratios) < 2:
        return 0.0
    middle = statistics.median(ratios)
    return (max(ratios) - min(ratios)) / middle if middle > 0 else 0.0


@dataclass
class Contention:
    """What a run saw: others' largest CPU share during a timed block, and each variant's largest spread."""

    others_cpu: Optional[float] = None
    spread: dict[str, float] = field(default_factory=dict)  # variant -> largest per-round speedup spread
    clock: str = "wall"  # bench's clock: CPU time ("cpu") is not inflated by others' work, only the wall clock is

    def add_block(self, share: Optional[float]) -> None:
        """Record another process's CPU share during a timed block; the worst one counts."""
        if share is not None:
            self.others_cpu = max(self.others_cpu or 0.0, share)

    def add_spread(self, name: str, spread: float) -> None:
        """Record how far a model's repeats spread; the widest one counts."""
        self.spread[name] = max(self.spread.get(name, 0.0), spread)

    def crowded(self) -> bool:
        """Others' work slowed the clock that was read (the wall clock: a CPU-time reading waits for nobody)."""
        return self.clock == "wall" and (self.others_cpu or 0.0) > OTHERS_CPU_LIMIT

    @property
    def reliable(self) -> bool:
        """Whether the timings can be trusted: nobody else on the CPUs and repeats that agree."""
        return not self.crowded() and all(s <= SPREAD_LIMIT for s in self.spread.values())

    def warning(self) -> Optional[str]:
        """One sentence for the user, or None when nothing was seen."""
        if self.reliable:
            return None
        reasons = []
        if self.crowded():
            reasons.append(f"other processes used {self.others_cpu:.0%} of this process's CPUs while it timed")
        moved = {k: v for k, v in self.spread.items() if v > SPREAD_LIMIT}
        if moved:
            worst = max(moved, key=moved.__getitem__)
            reasons.append(f"{worst}'s speedup moved by {moved[worst]:.0%} of its median between rounds")
        advice = "rerun on an idle machine with more --repeats" + (
            ", or use --clock cpu --threads 1 (other work does not inflate CPU time)" if self.clock == "wall" else "")
        return "these timings are unreliable: " + " and ".join(reasons) + "; " + advice

    def to_dict(self) -> dict[str, object]:
        """What ``bench --json`` reports of the machine's load beside its numbers."""
        return {"others_cpu": self.others_cpu, "speedup_spread": dict(self.spread), "clock": self.clock,
                "reliable": self.reliable}


@contextmanager
def watched(contention: Contention) -> Iterator[None]:
    """Record others' CPU share over the block into ``contention``."""
    start = sample()
    try:
        yield
    finally:
        contention.add_block(others_share(start, sample()))
