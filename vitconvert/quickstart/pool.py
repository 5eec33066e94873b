"""Independent trainings side by side in worker processes, each on one CPU thread (the quickstart's pool).

A small pool of our own rather than multiprocessing.Pool or ProcessPoolExecutor, for what those do not give
through public API: workers that ignore the terminal's Ctrl-C (the parent decides), that die with the parent
(Linux: PR_SET_PDEATHSIG), and that the parent kills outright when one job fails or the user interrupts, so a
failure ends everything within a second and leaves no process behind. Progress travels on the result queue.

Workers are forked where that is safe (Linux, and no thread started in this process since it imported torch:
no OpenMP pool a child would inherit half-alive), so they start with torch, timm and vitconvert already
imported instead of importing them again (~6 CPU-seconds a worker), and share one TeacherCache (the teacher's
outputs, computed by the first student to reach a batch); elsewhere they are spawned and share nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

import torch

from ..distill.teacher_cache import TeacherCache
from ..errors import VitconvertError, first_line
from ..threads import torch_threads
from .jobs import Job, Progress, Result, Update, train_one

STEP_EVERY = 5  # optimizer steps between progress messages from a worker
# What a training imports on first use (optimizer, schedule, loss, checkpoint, plots): imported here once before
# the workers fork rather than in each of them. matplotlib is optional.
PRELOAD = ("timm.loss", "timm.optim", "timm.scheduler", "timm.utils", "torch.distributed.checkpoint.state_dict",
           "matplotlib.figure", "matplotlib.backends.backend_agg")


def os_threads() -> int:
    """This process's threads as the kernel counts them (torch's OpenMP pool included; 0 where unknown)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


NATIVE_AFTER_IMPORT = os_threads() - threading.active_count()  # torch's import leaves OpenBLAS's (fork-safe)


def start_method() -> str:
    """fork while this process runs no Python thread but its main one (none holds a lock a child would inherit)
    and no native thread beyond those importing torch left (no OpenMP pool: no torch op has run on several
    threads); else spawn. Never fork a process that holds torch's threads."""
    native = os_threads() - threading.active_count()
    forkable = sys.platform.startswith("linux") and threading.active_count() == 1 and 0 <= native <= NATIVE_AFTER_IMPORT
    return "fork" if forkable else "spawn"


class JobPool:
    """``workers`` processes started on entry, the jobs' results from :meth:`results`, every process gone on exit.

    Start it before this process runs torch (``run_quickstart`` evaluates the teacher inside it), so the workers
    can be forked; with one worker the jobs run in this process, one after another, in :meth:`results`."""

    def __init__(self, jobs: list[Job], out: Path, device: Optional[str], force: bool, workers: int):
        self.jobs, self.out, self.device, self.force, self.workers = jobs, out, device, force, workers
        self.processes: list[Any] = []
        self.done: dict[str, Result] = {}
        self.teacher_cache: Optional[TeacherCache] = None

    def __enter__(self) -> JobPool:
        if self.workers <= 1:
            self.teacher_cache = TeacherCache()
            return self
        if start_method() == "fork":
            for name in PRELOAD:
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)
        context = mp.get_context(start_method())  # asked again: an import that started a thread rules out fork
        if context.get_start_method() == "fork":  # one memory for all workers (spawned ones would each copy it)
            self.teacher_cache = TeacherCache(context.Lock())
        self.tasks: Any = context.Queue()
        self.events: Any = context.Queue()
        self.processes = [context.Process(target=_worker, args=(self.tasks, self.events, self.out, self.device,
                                                                self.force, self.teacher_cache), daemon=True,
                                          name=f"vitconvert-quickstart-{n}") for n in range(self.workers)]
        for process in self.processes:
            process.start()
        for task in [*enumerate(self.jobs), *[None] * self.workers]:  # after the start: no queue thread to fork
            self.tasks.put(task)
        return self

    def results(self, progress: Optional[Progress] = None) -> dict[str, Result]:
        """name -> Result of every job, ``progress`` told as each one moves; a worker's failure raises here."""
        if not self.processes:
            return _run_here(self.jobs, self.out, self.device, self.force, progress, self.teacher_cache)
        while len(self.done) < len(self.jobs):
            try:
                kind, payload = self.events.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self.processes if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise VitconvertError(f"a quickstart worker died (exit code {dead[0].exitcode})") from None
                continue
            if kind == "error":
                name, message = payload
                raise VitconvertError(f"{name}: {message}")
            if kind == "done":
                self.done[payload.name] = payload
            if progress is not None:
                progress(payload if kind == "update" else _done(payload))
        return self.done

    def __exit__(self, kind: Optional[type], error: Optional[BaseException], trace: Optional[TracebackType]) -> None:
        if not self.processes:
            return
        for process in self.processes:
            if process.is_alive() and len(self.done) < len(self.jobs):
                process.kill()
        for process in self.processes:
            process.join(timeout=10)
        self.tasks.close()
        self.events.close()


def _run_here(jobs: list[Job], out: Path, device: Optional[str], force: bool, progress: Optional[Progress],
              teacher_cache: Optional[TeacherCache]) -> dict[str, Result]:
    results = {}
    with torch_threads(1):
        for job in jobs:
            results[job.name] = train_one(job, out, device, force, _every(progress, STEP_EVERY), teacher_cache)
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


def _worker(tasks: Any, events: Any, out: Path, device: Optional[str], force: bool,
            teacher_cache: Optional[TeacherCache]) -> None:
    """A worker's life: one thread, the terminal's Ctrl-C ignored, dead with its parent; jobs until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # forked: not the parent's live display's proxies
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # forked from a process that had set it: eager training starts no inter-op thread
        pass
    send = _every(lambda update: events.put(("update", update)), STEP_EVERY)
    while (task := tasks.get()) is not None:
        _, job = task
        try:
            events.put(("done", train_one(job, out, device, force, send, teacher_cache)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent as one line, which stops everything
            message = first_line(e)
            if not isinstance(e, VitconvertError) and message != type(e).__name__:
                message = f"{type(e).__name__}: {message}"
            events.put(("error", (job.name, message)))
            return
