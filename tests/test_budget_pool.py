"""benchmarks/budget_pool.py and budget.run_one: a stop signal sent to a sweep's training worker ends that training
at its step with a checkpoint, ends the worker and the sweep (no further run starts, the other workers stop too),
a stop sent to the sweep itself reaches every worker, and the stopped run resumes from its checkpoint. It used to
go on: ProcessPoolExecutor's worker took the next run after a stopped one (kill -9 was needed), and budget.py
deleted the stopped run's folder, checkpoint included.

The pool's workers run ``stand_in`` below: the trainer's own StopRequest and TrainingStopped around a loop of
"steps", so the signal handling is the real one without a model in each worker."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from vitconvert.distill import TrainingStopped
from vitconvert.distill.signals import StopRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import budget  # noqa: E402  (scripts beside the package, not modules of it)
import budget_pool  # noqa: E402


def stand_in(name: str, marks: str, last_step: bool = False) -> dict:
    """``last_step``: the signal lands after the last step, so the run ends normally (as the trainer's does)."""
    with StopRequest() as stop:  # announced once a stop can be heard (a signal before it would kill the worker)
        Path(marks, name).write_text(str(os.getpid()))  # started, and by whom
        for step in range(600):
            time.sleep(0.05)
            if stop.requested and last_step:
                return {"name": name}
            if stop.requested:
                Path(marks, f"{name}.stopped").touch()
                raise TrainingStopped(f"stopped by {stop.requested} at step {step}", stop.requested)
    return {"name": name}


def when_started(marks: Path, names: list[str], act) -> threading.Thread:
    def wait() -> None:
        deadline = time.monotonic() + 120
        while not all((marks / n).is_file() and (marks / n).read_text() for n in names):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        act([int((marks / n).read_text()) for n in names])

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def test_a_sigterm_to_one_worker_ends_its_run_and_the_sweep(tmp_path):
    runs = [(name, str(tmp_path)) for name in "abcd"]
    done = []
    when_started(tmp_path, ["a", "b"], lambda pids: os.kill(pids[0], signal.SIGTERM))
    ended = budget_pool.run_pool(stand_in, runs, 2, lambda run, record: done.append(record), start="fork")
    assert ended is not None and ended[0] == 128 + signal.SIGTERM and ended[1].startswith("stopped by SIGTERM at step")
    # both trainings stopped at a step (the second by the sweep's forwarded SIGTERM); c and d never started
    assert done == [] and sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.stopped", "b", "b.stopped"]


def test_a_sigterm_to_the_sweep_reaches_its_worker(tmp_path):
    runs = [(name, str(tmp_path)) for name in "ab"]
    when_started(tmp_path, ["a"], lambda pids: os.kill(os.getpid(), signal.SIGTERM))
    ended = budget_pool.run_pool(stand_in, runs, 1, lambda run, record: None, start="fork")
    assert ended == (128 + signal.SIGTERM, "stopped by SIGTERM")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.stopped"]  # stopped at a step; b never started
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the sweep's handlers are put back


def test_a_signal_after_a_runs_last_step_still_ends_the_sweep(tmp_path):
    runs = [("a", str(tmp_path), True), ("b", str(tmp_path), True)]
    done = []
    when_started(tmp_path, ["a"], lambda pids: os.kill(os.getpid(), signal.SIGTERM))
    ended = budget_pool.run_pool(stand_in, runs, 1, lambda run, record: done.append(record), start="fork")
    assert ended == (128 + signal.SIGTERM, "stopped by SIGTERM")
    assert done == [{"name": "a"}] and sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # b never started


def test_a_stopped_run_keeps_its_checkpoint_and_resumes(tmp_path, monkeypatch):
    from vitconvert.distill.trainer import Trainer

    step = Trainer.optimizer_step

    def stop_at_step_5(self):
        step(self)
        if self.pos.step == 5 and not self.job.resume:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(Trainer, "optimizer_step", stop_at_step_5)
    work = tmp_path / "work"
    try:
        budget.run_one("relu", "paper", 1, 0, "same", work)
        raise AssertionError("the run was not stopped")
    except TrainingStopped as e:
        assert "SIGTERM at epoch 1, step 5" in str(e)
    assert (work / "run" / "checkpoint-last").is_dir() and (work / "cpu_seconds.json").is_file()
    record = budget.run_one("relu", "paper", 1, 0, "same", work)
    assert record["resumed"] is True and 0.0 < record["top1"] <= 1.0 and record["cpu_seconds"] > 0
    assert not work.exists()  # recorded: its folder is gone
