"""A reader that closes the pipe early (`vitconvert list | head -1`) ends the command quietly, with the status a
program SIGPIPE ends has (128 + 13, as `git log | head` gives), not exit 1, which reads as an error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = "import sys\nfrom vitconvert.cli import main\nsys.exit(main())\n"  # what pip writes, in short


def run_into_closed_pipe(command: list[str]) -> subprocess.CompletedProcess:
    """Run COMMAND with its stdout a pipe whose reader has already gone, so its first write breaks the pipe."""
    reader, writer = os.pipe()
    os.close(reader)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        return subprocess.run([sys.executable, *command], stdout=writer, stderr=subprocess.PIPE, cwd=ROOT, env=env,
                              text=True, timeout=120)
    finally:
        os.close(writer)


@pytest.mark.parametrize("args", [["list"], ["--help"], ["convert", "--help"], ["--version"]],
                         ids=["list", "help", "command-help", "version"])
def test_a_closed_pipe_ends_the_command_quietly(args):
    done = run_into_closed_pipe(["-m", "vitconvert", *args])
    assert (done.returncode, done.stderr) == (141, "")


def test_the_console_script_ends_quietly_too(tmp_path):
    script = tmp_path / "vitconvert"
    script.write_text(CONSOLE_SCRIPT)
    done = run_into_closed_pipe([str(script), "convert", "--help"])  # (`list` imports torch: seconds, tested above)
    assert (done.returncode, done.stderr) == (141, "")

