"""A failure never hangs: an exception in a loader worker, the teacher, a hook or in saving ends the command with
one `error:` line and a non-zero exit within seconds, no process left behind, and checkpoint-last/ intact.

Each case is a real `vitconvert` process (the failure patched in before the CLI starts; loader workers are forked,
so they inherit it). It used to hang: the workers ignored SIGTERM, so multiprocessing's exit handler, which
terminates daemonic children and then joins them, waited forever on a worker an exception had left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import invoke
from typer.testing import Result

from .helpers import FAST, make_images, make_student

INJECT = r"""
import time
from pathlib import Path

calls = {"n": 0}

def failing(message):
    mark.write_text(str(time.time()))
    return RuntimeError(message)

if kind == "item37":
    from vitconvert import data
    getitem = data.TransformedDataset.__getitem__
    def broken(self, index):
        if index == 37:
            raise failing("item 37 cannot be read")
        return getitem(self, index)
    patch(data.TransformedDataset, "__getitem__", broken)
    whole = data.TransformedDataset._batch  # (the digits are transformed a batch at a time)
    def broken_batch(self, indices):
        if 37 in indices:
            raise failing("item 37 cannot be read")
        return whole(self, indices)
    patch(data.TransformedDataset, "_batch", broken_batch)
elif kind == "teacher":  # epoch 2 of 12 steps each
    from vitconvert import capture
    call = capture.TeacherTap.__call__
    def broken(self, images):
        calls["n"] += 1
        if calls["n"] == 15:
            raise failing("the teacher failed")
        return call(self, images)
    patch(capture.TeacherTap, "__call__", broken)
elif kind == "hook":  # two attention hooks per training forward: step 15, in epoch 2
    from vitconvert import capture
    hook = capture.DistillStudent._hook
    def broken(self, module, args, output):
        calls["n"] += module.training  # validation runs the hooks too
        if calls["n"] == 30:
            raise failing("a hook failed")
        return hook(self, module, args, output)
    patch(capture.DistillStudent, "_hook", broken)
elif kind == "save":  # the second checkpoint dies after its first file: a disk that filled up
    import safetensors.torch
    save_file = safetensors.torch.save_file
    def broken(tensors, filename, *args, **kwargs):
        if str(filename).endswith("optimizer.safetensors"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(28, "No space left on device", filename) from failing("disk full")
        return save_file(tensors, filename, *args, **kwargs)
    patch(safetensors.torch, "save_file", broken)

elif kind == "slow":  # not a failure: slow images, and a mark once the workers read them
    from vitconvert import data
    getitem = data.TransformedDataset.__getitem__
    def slow(self, index):
        if not mark.exists():
            mark.write_text(str(time.time()))
        time.sleep(0.05)
        return getitem(self, index)
    patch(data.TransformedDataset, "__getitem__", slow)
"""
# the failure patched in before the CLI starts, in a process of its own (``INJECT`` reads kind, mark and patch)
HARNESS = r"""
import os, sys
from pathlib import Path

kind, mark, patch = os.environ["FAIL_KIND"], Path(os.environ["FAIL_MARK"]), setattr
""" + INJECT + r"""
from vitconvert.cli import main
sys.argv = ["vitconvert", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("failures")
    # 48 training images: 12 full batches of 4, so item 37 is in every epoch (no tail dropped); 42 to validate.
    return make_student(root), make_images(root / "images", per_class=16, val_per_class=14)


def session_processes(sid: int) -> list[str]:
    """Processes (not zombies) still in the session the command started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(stat.parent.name)
    return found


def run_failing(kind: str, args: list, tmp_path: Path) -> subprocess.CompletedProcess:
    mark = tmp_path / "failed-at"
    env = {**os.environ, "FAIL_KIND": kind, "FAIL_MARK": str(mark), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "COLUMNS": "200"}
    env.pop("VITCONVERT_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-c", HARNESS, *map(str, args)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{kind}: vitconvert {args[0]} hung after the failure")
    ended = time.time()
    left = session_processes(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert mark.is_file(), f"the failure was never injected: {err}"
    assert ended - float(mark.read_text()) < 10, f"{ended - float(mark.read_text()):.1f} s from failure to exit"
    assert left == [], f"processes left behind: {left}"
    assert proc.returncode != 0
    lines = err.strip().splitlines()  # epoch lines may come first
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, err
    assert "Traceback" not in out + err
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def children() -> set[str]:
    """This process's children that are still running (not zombies)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":  # (state, ppid, ...)
            found.add(stat.parent.name)
    return found


def run_failing_here(kind: str, args: list, tmp_path: Path, monkeypatch) -> Result:
    """``run_failing``'s command and checks in this process (typer's runner; its loader workers are forked from
    here and inherit the failure): the command's own error funnel, and its workers already ended when it returns,
    so that a process's exit (``run_failing``) would have none to wait for."""
    mark = tmp_path / "failed-at"
    exec(INJECT, {"kind": kind, "mark": mark, "patch": monkeypatch.setattr})
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)
    before = children()
    result = invoke(*args)
    ended = time.time()
    assert children() <= before, f"worker processes left running: {children() - before}"
    assert mark.is_file(), f"the failure was never injected: {result.stderr}"
    assert ended - float(mark.read_text()) < 10, f"{ended - float(mark.read_text()):.1f} s from failure to exit"
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()  # epoch lines may come first
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, result.stderr
    assert "Traceback" not in result.output + result.stderr
    return result


def distill_args(student: Path, images: Path, run: Path, workers: int, epochs: int = 1) -> list:
    sets = {**FAST, "epochs": epochs, "workers": workers, "compare_batches": 0}
    return ["distill", student, "--data", images, "--out", run,
            *[a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]]


def failing_commands(setup, tmp_path: Path, workers: int) -> dict[str, list]:
    student, images = setup
    return {
        "distill": distill_args(student, images, tmp_path / "distill" / "run", workers),
        "eval": ["eval", student, "--data", images, "--batch-size", 4, "--workers", workers],
        "compare": ["compare", student, "--data", images, "--batches", 12, "--batch-size", 4, "--workers", workers],
    }


def test_a_worker_exception_ends_distill_eval_and_compare(setup, tmp_path, monkeypatch):
    """distill as a process: its exit once hung on a worker the exception left running. eval and compare take
    their loaders from the same make_loader; in this process, their workers are gone when the command returns."""
    for command, args in failing_commands(setup, tmp_path, workers=2).items():
        (tmp_path / command).mkdir()
        if command == "distill":
            result = run_failing("item37", args, tmp_path / command)
        else:
            result = run_failing_here("item37", args, tmp_path / command, monkeypatch)
        assert "item 37 cannot be read" in result.stderr, (command, result.stderr)
        assert "(in DataLoader worker process" in result.stderr, result.stderr


def test_an_exception_reading_an_image_without_workers_ends_distill_eval_and_compare(setup, tmp_path, monkeypatch):
    """The same failure read in the command's own process (--workers 0)."""
    for command, args in failing_commands(setup, tmp_path, workers=0).items():
        (tmp_path / command).mkdir()
        result = run_failing_here("item37", args, tmp_path / command, monkeypatch)
        assert "item 37 cannot be read" in result.stderr, (command, result.stderr)


def test_a_worker_exception_ends_quickstart(tmp_path):
    result = run_failing("item37", ["quickstart", "--out", tmp_path / "qs", "--epochs", 1, "--variants", "elu"],
                         tmp_path)
    assert "item 37 cannot be read" in result.stderr


@pytest.mark.parametrize("kind", ["teacher", "hook", "save"])
def test_a_failure_in_epoch_two_keeps_the_checkpoint_of_epoch_one(setup, tmp_path, monkeypatch, kind):
    """All with two loader workers. The teacher's failure as a process: the exit with workers alive mid-epoch.
    A hook fails at the same point of the step, and the save after the epoch's loops: in this process, where
    run_failing_here also checks that no worker outlives the command."""
    student, images = setup
    run = tmp_path / "run"
    args = distill_args(student, images, run, workers=2, epochs=2)
    if kind == "teacher":
        result = run_failing(kind, args, tmp_path)
    else:
        result = run_failing_here(kind, args, tmp_path, monkeypatch)
    assert {"teacher": "the teacher failed", "hook": "a hook failed", "save": "No space left"}[kind] in result.stderr
    meta = json.loads((run / "checkpoint-last" / "trainer.json").read_text())
    assert meta["position"]["epoch"] == 1 and meta["position"]["batch"] == 0
    assert {p.name for p in (run / "checkpoint-last").iterdir()} >= {"model.safetensors", "optimizer.safetensors",
                                                                     "rng.safetensors", "trainer.json"}
    assert sorted(p.name for p in run.iterdir() if "tmp" in p.name) == []  # no half-written sibling


def test_a_sigterm_to_the_process_group_still_stops_cleanly_with_a_checkpoint(setup, tmp_path):
    """A scheduler's SIGTERM reaches the workers too: they ignore it, so the trainer finishes its step and saves
    (and then ends them), rather than failing on workers killed under it."""
    student, images = setup
    run, mark = tmp_path / "run", tmp_path / "failed-at"
    env = {**os.environ, "FAIL_KIND": "slow", "FAIL_MARK": str(mark), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", HARNESS, *map(str, distill_args(student, images, run, 2, 3))],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while not mark.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # a few steps in
        os.killpg(proc.pid, signal.SIGTERM)
        sent = time.time()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.time() - sent < 10
    assert session_processes(proc.pid) == []
    # a stop that was asked for is not an error: 128 + SIGTERM, and the line says how to continue
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 128 + signal.SIGTERM and last.startswith("stopped by SIGTERM"), (proc.returncode, err)
    assert f"vitconvert distill --resume --out {run}" in last, last
    assert json.loads((run / "checkpoint-last" / "trainer.json").read_text())["position"]["step"] >= 1
