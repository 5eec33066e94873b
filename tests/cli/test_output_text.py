"""No silence, nothing unreadable (issue 23): output to a pipe keeps every column and digit, long work says it
is working, a non-terminal distill prints progress within an epoch, and --help shows flags as flags."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
from distill.helpers import CLI_FAST, make_workspace
from helpers import assert_one_line_error, invoke

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


def test_a_kernel_table_on_a_narrow_terminal_wraps_names_and_cuts_none(ws):
    """`info --kernels` on an 80-column terminal: rich cut each kernel name to 'attenti…'; now it wraps them."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm", "NO_COLOR": "1"}
    env.pop("COLUMNS", None)
    proc = subprocess.Popen([sys.executable, "-m", "vitconvert", "info", str(ws / "student-elu"), "--kernels", "--gpu",
                             "h100"], env=env, stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.DEVNULL)
    os.close(follower)
    shown = b""
    while chunk := _read(leader):
        shown += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode())
    lines = [line for line in text.splitlines() if line.strip()]
    assert "…" not in text and max(map(len, lines)) <= 80, text
    assert "NVIDIA H100" in text and sum("blocks." in line for line in lines) == 2, text  # the 2 layers of the student


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: the command closed the terminal
        return b""


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
    beats = [common.HEARTBEAT_LINE.match(line) for line in result.stderr.splitlines()]
    assert "converting to elu (mimetic attention init)" in {m["what"] for m in beats if m}, result.stderr
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


def test_top_level_help_shows_version_as_a_flag():
    result = invoke("--help")
    assert result.exit_code == 0 and "--version" in result.output and "<bool>" not in result.output, result.output


def test_quickstart_help_gives_its_epochs_as_a_number():
    """It showed "[default: recipes/quickstart]", a path where a number belongs."""
    from vitconvert.recipes import load_recipe

    shown = " ".join(invoke("quickstart", "--help", env={"COLUMNS": "400"}).output.split())
    assert f"[default: {load_recipe('quickstart')[0].epochs}, the quickstart recipe's]" in shown, shown
    assert "recipes/quickstart" not in shown


def test_convert_and_info_say_what_the_folder_is_in_words(tmp_path, monkeypatch):
    """A random source is called random; options as KEY=VALUE, not a Python dict; a hybrid's layers counted out of
    the model's depth (a 12-layer hybrid with one softmax layer was "11 attention layers")."""
    monkeypatch.chdir(tmp_path)
    made = invoke("convert", "vit_tiny_patch16_224", "--no-pretrained", "--to", "elu", "--attn-init", "copy",
                  "--img-size", "32", "--keep-softmax", "0", "--out", "r", env={"COLUMNS": "400"})
    assert made.exit_code == 0, made.output
    assert "(11 of 12 attention layers linear)" in made.stdout, made.stdout
    shown = " ".join(invoke("info", "r", env={"COLUMNS": "400"}).stdout.split())
    assert "vit_tiny_patch16_224 (randomly initialised: converted with --no-pretrained)" in shown, shown
    assert "elu (eps=1e-06, feature_map=fixed)" in shown and "{'" not in shown, shown  # init_scale: hedgehog's only
    assert "attn=copy, mlp=copy" in shown, shown
    assert re.search(r"attention layers\W+12\W", shown) and "linear 1-11, softmax 0" in shown, shown


def test_a_run_folder_gives_top1_as_a_fraction_in_json_and_a_percent_in_words(ws, tmp_path, monkeypatch):
    """Every --json of the CLI gives accuracies as fractions of 1 (eval, distill, compare, and info, whose folder
    keeps percent for its card); tables say "%". The quickstart recipe's random crops are augmentation, and one
    epoch is "1 epoch"."""
    monkeypatch.chdir(tmp_path)
    ran = invoke("distill", ws / "student-elu", "--recipe", "quickstart", "--data", ws / "images", "--epochs", "1",
                 *CLI_FAST, "--out", "r")
    assert ran.exit_code == 0, ran.output
    assert "quickstart: 1 epoch," in ran.output and "augmentation: random crops (area 0.5-1)" in ran.output, ran.output
    top1 = json.loads(invoke("info", "r", "--json").stdout)["metrics"]["top1"]
    evaluated = json.loads(invoke("eval", "r", "--data", ws / "images", "--json").stdout)
    assert 0 <= top1 <= 1 and evaluated["top1"] == pytest.approx(top1, abs=1e-4)
    shown = " ".join(invoke("info", "r", env={"COLUMNS": "400"}).stdout.split())
    assert f"val top1 {100 * top1:.2f}%" in ran.output and f"top-1 {100 * top1:.2f}%" in shown, shown
    assert "after 1 epoch" in shown, shown


def test_offline_without_the_weights_names_the_switch(hub_cache, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE set, weights not cached: our sentence naming the switch, not huggingface_hub's broken one
    ("... check your connection and try again or make sure your Internet connection")."""
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", "deit_tiny", "--to", "elu", "--out", "s")
    assert_one_line_error(result, "cannot get pretrained weights for deit_tiny: HF_HUB_OFFLINE is set and "
                                  "timm/deit_tiny_patch16_224.fb_in1k is not in the Hub cache; unset HF_HUB_OFFLINE")
    assert "Internet connection" not in result.stderr and not (tmp_path / "s").exists()
