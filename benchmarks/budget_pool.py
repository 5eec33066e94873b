"""benchmarks/budget.py's runs in worker processes that a stop signal ends cleanly, so the sweep resumes.

concurrent.futures' ProcessPoolExecutor did not: its worker caught the TrainingStopped that a SIGTERM raises
(the trainer finishes its step and saves a checkpoint), sent it to the parent and took the next run, so a
SIGTERM sent to a training worker stopped one training and the worker went on training the next (kill -9 was
needed); budget.py then deleted the stopped run's folder, checkpoint included; and a signal sent to the parent
never reached the workers. Here a worker ends after a stopped run, a stop of any worker or of the parent is
sent on to every worker (each saves its checkpoint), no new run starts, and the parent exits 128 + the signal
number; the same command run again resumes each stopped run from its checkpoint (budget.run_one).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
from collections.abc import Callable
from typing import Any, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class WorkerStopped(Exception):
    """A stop signal reached a worker outside a training (whose own handler saves and raises TrainingStopped)."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.signal_name = signal_name


def _raise_stopped(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    raise WorkerStopped(f"stopped by {name}", name)


def _worker(fn: Callable[..., dict[str, Any]], tasks: Any, events: Any, stopping: Any) -> None:
    """Runs until the tasks end, the sweep is stopping, or one run stops or fails; then this process ends.

    ``stopping`` covers a signal the trainer took after its last step: the run ends normally (its handler had
    no step left to stop after) and the worker must still take no further run."""
    from vitconvert.distill import TrainingStopped
    from vitconvert.errors import first_line

    for sig in STOP_SIGNALS:  # the trainer's handlers replace these while it trains and put them back after
        signal.signal(sig, _raise_stopped)
    task = None
    try:
        while not stopping.is_set() and (task := tasks.get()) is not None:
            events.put(("done", os.getpid(), task, fn(*task)))
    except (TrainingStopped, WorkerStopped) as e:
        _ignore_stops()
        code = 128 + int(signal.Signals[e.signal_name])
        events.put(("stopped", os.getpid(), task, (code, str(e).splitlines()[0])))
    except BaseException as e:  # noqa: BLE001 - one line to the parent, which ends the sweep
        _ignore_stops()
        events.put(("error", os.getpid(), task, (1, f"{task}: {first_line(e)}")))


def _ignore_stops() -> None:
    """A worker that has stopped takes no further signal: its last message must reach the parent."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def run_pool(fn: Callable[..., dict[str, Any]], runs: list[tuple], jobs: int,
             on_done: Callable[[tuple, dict[str, Any]], None], start: str = "spawn") -> Optional[tuple[int, str]]:
    """``fn(*run)`` for every run in ``jobs`` fresh processes, ``on_done(run, record)`` as each finishes. Returns
    None when all finished, else (exit code, one line) of the stop (128 + signal) or failure (1) that ended it.
    ``start``: spawn, as budget.py runs (never fork a process that may hold torch's threads); the tests fork."""
    jobs = min(jobs, len(runs))  # no idle worker: each spawned one imports torch and timm (~7 CPU-s) to do nothing
    context = mp.get_context(start)
    tasks, events, stopping = context.Queue(), context.Queue(), context.Event()
    for run in runs:
        tasks.put(run)
    for _ in range(jobs):
        tasks.put(None)
    workers = [context.Process(target=_worker, args=(fn, tasks, events, stopping), name=f"budget-{n}")
               for n in range(jobs)]
    for w in workers:
        w.start()
    ended: Optional[tuple[int, str]] = None
    reported: set[int] = set()  # workers that stopped or failed: they take no further signal

    def stop_all(signum: int, frame: Any = None) -> None:
        nonlocal ended
        ended = ended or (128 + signum, f"stopped by {signal.Signals(signum).name}")
        stopping.set()
        for w in workers:
            if w.is_alive() and w.pid is not None and w.pid not in reported:
                os.kill(w.pid, signal.SIGTERM)  # the trainer saves its checkpoint and stops after its step

    previous = {sig: signal.signal(sig, stop_all) for sig in STOP_SIGNALS}
    try:
        while any(w.is_alive() for w in workers) or not events.empty():
            try:
                kind, pid, run, payload = events.get(timeout=1.0)
            except queue.Empty:
                continue
            if kind == "done":
                on_done(run, payload)
                continue
            reported.add(pid)
            if ended is None:  # the first stop or failure ends the sweep: every other run saves and stops
                ended = payload
                stop_all(signal.SIGTERM)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for w in workers:
            w.join(timeout=60)
    failed = [w for w in workers if w.exitcode not in (0, None)]
    if ended is None and failed:
        return 1, f"a budget worker died (exit code {failed[0].exitcode})"
    return ended
