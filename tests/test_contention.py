"""bench says when its times cannot be trusted: other processes on its CPUs, or rounds that disagree (issue 39:
the same command gave 4.95×, 1.00× and 0.71× on a busy machine, with no word)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest

from vitconvert import contention
from vitconvert.contention import Contention, CpuSample, busy_seconds, others_share, speedup_spread, watched

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")


def test_others_share_is_the_busy_time_that_was_not_ours():
    start, end = CpuSample(0.0, 100.0, 5.0), CpuSample(2.0, 103.0, 6.0)  # 2 s on 2 CPUs: 3 s busy, 1 s ours
    assert others_share(start, end, cpus=2) == pytest.approx(0.5)
    assert others_share(start, CpuSample(2.0, 101.0, 6.0), cpus=2) == 0.0  # only our own work
    assert others_share(CpuSample(0.0, None, 0.0), end, cpus=2) is None  # unreadable: unknown, not zero


def test_busy_seconds_reads_only_the_given_cpus(tmp_path):
    stat = tmp_path / "stat"
    tick = os.sysconf("SC_CLK_TCK")
    stat.write_text(f"cpu  {9 * tick} 0 0 0 0 0 0 0 0 0\n"
                    f"cpu0 {2 * tick} 0 {tick} 50 7 0 0 0 0 0\n"
                    f"cpu1 {5 * tick} 0 0 50 0 0 0 {tick} 0 0\n")
    assert busy_seconds({0}, str(stat)) == pytest.approx(3.0)  # user + system; idle and iowait are not busy
    assert busy_seconds({0, 1}, str(stat)) == pytest.approx(9.0)  # steal counts: the CPU was not ours
    assert busy_seconds({0}, str(tmp_path / "none")) is None


def test_spread_is_of_the_per_round_speedups():
    assert speedup_spread([10, 10, 10], [5, 5, 5]) == 0.0
    assert speedup_spread([10, 30, 20], [4, 100, 5]) == pytest.approx((4.0 - 0.3) / 2.5)
    assert speedup_spread([10], [5]) == 0.0


def test_a_clean_run_says_nothing_and_a_contended_one_says_why():
    clean = Contention(0.05, {"elu": 0.1})
    assert clean.reliable and clean.warning() is None
    busy = Contention(0.8, {"elu": 0.1, "relu": 2.0})
    assert not busy.reliable
    assert busy.warning().startswith("these timings are unreliable: other processes used 80%")
    assert "relu's speedup moved by 200%" in busy.warning() and "--clock cpu --threads 1" in busy.warning()
    assert Contention(None, {"elu": 0.5}).warning().startswith("these timings are unreliable: elu's")


def test_others_work_does_not_discredit_cpu_time():
    """--clock cpu reads CPU time, which waiting for a core does not inflate: only its rounds' spread counts."""
    assert Contention(0.8, {"elu": 0.1}, clock="cpu").reliable
    moved = Contention(0.8, {"elu": 0.9}, clock="cpu")
    assert not moved.reliable and "other processes" not in moved.warning() and "--clock cpu" not in moved.warning()


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@linux_only
def test_processes_spinning_on_our_cpus_are_seen():
    """Real load: one spinning process per CPU we may use while we sleep: others took most of our CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")
    spinners = [context.Process(target=spin, args=(4.0,)) for _ in cpus]
    for p in spinners:
        p.start()
    try:
        time.sleep(1.0)  # the spinners are up
        seen = Contention()
        with watched(seen):
            time.sleep(1.0)
    finally:
        for p in spinners:
            p.join()
    assert seen.others_cpu is not None and seen.others_cpu > contention.OTHERS_CPU_LIMIT, seen
    assert not seen.reliable
