"""The CLI's shared parsing and error mapping."""

from __future__ import annotations

import os

import pytest
import typer

from vitconvert.cli.common import parse_pairs, user_errors
from vitconvert.errors import BadValue, VitconvertError


def test_key_value_pairs_read_yaml_and_numbers_without_a_dot():
    """YAML 1.1 reads 1e-5 as text; `--option eps=1e-5` means the number."""
    assert parse_pairs(["eps=1e-5", "loss=cosine", "on=true", "pair=[2, 2]", "none=null", "inf=inf"], "--option") == \
        {"eps": 1e-5, "loss": "cosine", "on": True, "pair": [2, 2], "none": None, "inf": "inf"}
    with pytest.raises(VitconvertError, match="--set expects KEY=VALUE"):
        parse_pairs(["epochs"], "--set")


def test_a_library_error_about_a_value_is_shown_with_its_flag(capsys):
    @user_errors
    def command():
        raise BadValue("img_size", "expects positive integers, got '0'")

    with pytest.raises(typer.Exit) as ended:
        command()
    assert ended.value.exit_code == 1
    assert capsys.readouterr().err.strip() == "error: --img-size: expects positive integers, got '0'"


def test_a_parameter_whose_flag_is_spelled_otherwise_is_shown_with_that_flag(capsys):
    """convert's ``options`` dict comes from repeated --option pairs: the message names --option."""
    @user_errors
    def command():
        raise BadValue("options", "mhla cannot be built with eps=0")

    with pytest.raises(typer.Exit):
        command()
    assert capsys.readouterr().err == "error: --option: mhla cannot be built with eps=0\n"


def run_with_stderr_on_a_terminal(args: list[str], cwd) -> tuple[int, str, str]:
    """``python -m vitconvert ARGS`` with stderr on a pseudo-terminal (as in a shell) and stdout on a pipe: exit
    code, stdout, and what the terminal showed."""
    import pty
    import subprocess
    import sys
    from pathlib import Path

    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "vitconvert", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the command closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    out = proc.stdout.read().decode()
    return proc.wait(timeout=120), out, shown.decode(errors="replace")


def test_a_command_says_it_is_loading_torch_on_a_terminal_and_nothing_in_a_pipe(tmp_path, monkeypatch):
    """The first seconds are torch's and timm's imports: a terminal is told so at once (a status line rich clears
    when they are done); a pipe or log gets no spinner frames, only the output (typer's runner: stderr is no
    terminal there either, and the same words are or are not said around the same imports)."""
    from helpers import invoke

    code, out, shown = run_with_stderr_on_a_terminal(["list"], tmp_path)
    assert code == 0 and "mhla" in out
    assert "loading torch and timm" in shown
    monkeypatch.chdir(tmp_path)
    piped = invoke("list")
    assert piped.exit_code == 0 and piped.stderr == "" and piped.stdout == out
