"""Independent trainings side by side in worker processes, each on one CPU thread (the quickstart's pool).

A small pool of our own rather than multiprocessing.Pool or ProcessPoolExecutor, for what those do not give
through public API: workers that ignore the terminal's Ctrl-C (the parent decides), that die with the parent
(Linux: PR_SET_PDEATHSIG), and that the parent kills outright when one job fails or the user interrupts, so a
failure ends everything within a second and leaves no process behind. Progress travels on the result queue.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import queue
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import VitconvertError, first_line
from ..threads import torch_threads
from .jobs import Job, Progress, Result, Update, train_one

STEP_EVERY = 5  # optimizer steps between progress messages from a worker


def run_jobs(jobs: list[Job], out: Path, device: Optional[str], force: bool, workers: int,
             progress: Optional[Progress] = None) -> dict[str, Result]:
    """name -> Result of every job, run by ``workers`` processes (1: in this process, one after another)."""
    if workers <= 1:
        return _run_here(jobs, out, device, force, progress)
    context = mp.get_context("spawn")  # never fork a process that holds torch's threads
    tasks: Any = context.Queue()
    events: Any = context.Queue()
    for index, job in enumerate(jobs):
        tasks.put((index, job))
    for _ in range(workers):
        tasks.put(None)
    pool = [context.Process(target=_worker, args=(tasks, events, out, device, force), daemon=True,
                            name=f"vitconvert-quickstart-{n}") for n in range(workers)]
    for process in pool:
        process.start()
    results: dict[str, Result] = {}
    try:
        while len(results) < len(jobs):
            try:
                kind, payload = events.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in pool if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise VitconvertError(f"a quickstart worker died (exit code {dead[0].exitcode})") from None
                continue
            if kind == "error":
                name, message = payload
                raise VitconvertError(f"{name}: {message}")
            if kind == "done":
                results[payload.name] = payload
            if progress is not None:
                progress(payload if kind == "update" else _done(payload))
    finally:
        for process in pool:
            if process.is_alive() and len(results) < len(jobs):
                process.kill()
        for process in pool:
            process.join(timeout=10)
        tasks.close()
        events.close()
    return results


def _run_here(jobs: list[Job], out: Path, device: Optional[str], force: bool,
              progress: Optional[Progress]) -> dict[str, Result]:
    results = {}
    with torch_threads(1):
        for job in jobs:
            results[job.name] = train_one(job, out, device, force, _every(progress, STEP_EVERY))
            if progress is not None:
                progress(_done(results[job.name]))
    return results


def _done(result: Result) -> Any:
    return Update(result.name, "done", result=result)


def _every(progress: Optional[Progress], steps: int) -> Optional[Progress]:
    """Only every ``steps``-th step's update (and each epoch's last), to keep the display cheap."""
    if progress is None:
        return None

    def forward(update: Any) -> None:
        if update.step % steps == 0 or update.step == update.steps:
            progress(update)

    return forward


def _worker(tasks: Any, events: Any, out: Path, device: Optional[str], force: bool) -> None:
    """A worker's life: one thread, the terminal's Ctrl-C ignored, dead with its parent; jobs until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    send = _every(lambda update: events.put(("update", update)), STEP_EVERY)
    while (task := tasks.get()) is not None:
        _, job = task
        try:
            events.put(("done", train_one(job, out, device, force, send)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent as one line, which stops everything
            message = first_line(e)
            if not isinstance(e, VitconvertError) and message != type(e).__name__:
                message = f"{type(e).__name__}: {message}"
            events.put(("error", (job.name, message)))
            return
