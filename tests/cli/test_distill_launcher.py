"""`vitconvert distill` under a stray or half-started torchrun environment: one error line, nothing written, never
a silent run or an endless wait. A missing process is waited for as a user runs it (a subprocess, where torch's
rendezvous runs); the settings refused before any rendezvous go through typer's runner."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from distill.helpers import make_images, make_student
from helpers import invoke


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("launcher")
    return make_student(root), make_images(root / "images")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distill(workspace, cwd, **env):
    student, images = workspace
    cmd = [sys.executable, "-m", "vitconvert", "distill", str(student), "--data", str(images), "--epochs", "1",
           "--out", "run"]
    full = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=150)
    return done, time.monotonic() - start


def distill_here(workspace, cwd, monkeypatch, **env):
    """The same command and environment as ``distill``, in this process."""
    student, images = workspace
    monkeypatch.chdir(cwd)
    for name, value in {"HF_HUB_OFFLINE": "1", **env}.items():
        monkeypatch.setenv(name, value)
    return invoke("distill", student, "--data", images, "--epochs", "1", "--out", "run")


def test_a_rank_past_the_world_size_is_refused(workspace, tmp_path, monkeypatch):
    done = distill_here(workspace, tmp_path, monkeypatch, WORLD_SIZE="1", RANK="3")
    assert done.exit_code == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: the environment variable RANK=3 is not below WORLD_SIZE=1 (ranks run from 0 to 0): these are "
        "torchrun's to set; unset RANK and WORLD_SIZE to run one process"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rank", [1, 0])
def test_a_missing_process_is_named_and_timed_out(workspace, tmp_path, rank):
    """Rank 1 without rank 0 (nothing listens) and rank 0 without rank 1 (nobody joins): both say first what they
    wait for, then give up after VITCONVERT_DIST_TIMEOUT with one error line."""
    port = free_port()
    done, seconds = distill(workspace, tmp_path, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VITCONVERT_DIST_TIMEOUT="2")
    assert done.returncode == 1 and done.stdout == ""
    waiting, error = done.stderr.strip().splitlines()
    assert waiting == (f"rank {rank} of 2: waiting up to 2s for all 2 processes to meet at 127.0.0.1:{port} "
                       "(VITCONVERT_DIST_TIMEOUT sets the wait)")
    why = "no process answers" if rank else "the processes did not all meet"
    assert error.startswith(f"error: rank {rank} of 2: {why} at 127.0.0.1:{port} within 2s ("), error
    assert error.endswith("set VITCONVERT_DIST_TIMEOUT to wait longer, or unset WORLD_SIZE and RANK to run one "
                          "process"), error
    assert seconds < 120  # not torch's 30 minutes
    assert list(tmp_path.iterdir()) == []


def test_a_timeout_that_is_no_number_is_refused(workspace, tmp_path, monkeypatch):
    done = distill_here(workspace, tmp_path, monkeypatch, WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(free_port()), VITCONVERT_DIST_TIMEOUT="soon")
    assert done.exit_code == 1
    assert done.stderr.strip().splitlines() == [
        "error: VITCONVERT_DIST_TIMEOUT='soon': expected the seconds the processes of a torchrun may take to meet, "
        "a positive number (default 300)"]
