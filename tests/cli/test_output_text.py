"""No silence, nothing unreadable (issue 23): output to a pipe keeps every column and digit, long work says it
is working, a non-terminal distill prints progress within an epoch, and --help shows flags as flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
from distill.helpers import CLI_FAST, make_workspace
from helpers import invoke

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("output-text"))


def test_a_piped_table_keeps_every_column(ws):
    """Through a real pipe (not a terminal): rich assumed 80 columns and cut cells to '…'."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "", "HF_HUB_OFFLINE": "1"}
    env.pop("COLUMNS")
    out = subprocess.run([sys.executable, "-m", "vitconvert", "info", str(ws / "student-elu")], env=env,
                         capture_output=True, text=True, timeout=120).stdout
    assert f"safetensors {safetensors.__version__}" in out and "…" not in out, out


@pytest.mark.parametrize("command", ["convert", "distill", "export", "compare", "bench"])
def test_help_shows_flags_without_a_value(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0 and "--force" in result.output
    assert "<bool>" not in result.output, result.output


def test_help_shows_square_brackets_as_written():
    """typer reads help as rich markup, where "[default: …]" and "[@revision]" were tags and vanished."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "400"}
    shown = {command: subprocess.run([sys.executable, "-m", "vitconvert", command, "--help"], env=env,
                                     capture_output=True, text=True, timeout=120).stdout
             for command in ("convert", "compare")}
    assert "output folder [default: ./<timm-name>-<variant>]" in shown["convert"], shown["convert"]
    assert "hf-hub:org/name[@revision]" in shown["compare"], shown["compare"]


@pytest.mark.parametrize("command", ["convert", "distill", "eval", "compare", "bench", "export", "push", "quickstart",
                                     "list", "info", "upgrade"])
def test_help_escapes_nothing_twice(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0 and "\\[" not in result.output, result.output


def test_long_work_says_it_is_working(ws, tmp_path, monkeypatch):
    """Each stage that runs past the threshold prints a line (10 s in use; 0 here)."""
    import vitconvert.cli.common as common

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "HEARTBEAT_AFTER_S", 0.0)
    result = invoke("convert", ws / "teacher", "--to", "elu", "--out", "s", "--json")
    assert result.exit_code == 0, result.output
    assert "converting to elu (mimetic attention init)..." in result.stderr, result.stderr
    json.loads(result.stdout)  # stdout stays the one JSON object


def test_a_non_terminal_distill_prints_progress_within_an_epoch(ws, tmp_path, monkeypatch):
    import vitconvert.distill.monitor as monitor

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(monitor, "LOG_EVERY_S", 0.0)
    result = invoke("distill", ws / "student-elu", "--data", ws / "images", "--epochs", "1", *CLI_FAST, "--out", "r")
    assert result.exit_code == 0, result.output
    assert "epoch 1/1 joint step 1/3" in result.stderr and "step 3/3" in result.stderr, result.stderr


def test_an_unreachable_hub_is_one_line_at_once(hub_cache, tmp_path, monkeypatch):
    """Not marked offline, no network, weights not cached: one line in seconds, not a minute of huggingface_hub's
    'Retrying in 8s' warnings (the endpoint here is a refused local port)."""
    import time

    import huggingface_hub.constants as constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    result = invoke("convert", "deit_tiny", "--to", "elu", "--out", "s")
    assert time.perf_counter() - start < 15
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and "does not answer" in lines[0], result.stderr
    assert "use --no-pretrained" in lines[0] and not (tmp_path / "s").exists()


def test_quickstart_in_a_log_says_each_stage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("quickstart", "--variants", "elu", "--epochs", "1", "--no-scratch", "--jobs", "1", "--out", "q")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[:3] == ["elu: queued", "elu: converting", "elu: running, epoch 1/1"], lines
