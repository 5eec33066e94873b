"""One line for any exception: the first line of its message, its type when the message is empty."""

from __future__ import annotations

import pytest
import typer

from vitconvert.cli.common import summary, user_errors
from vitconvert.errors import VitconvertError, first_line


@pytest.mark.parametrize("error,line", [
    (AssertionError(), "AssertionError"),
    (ValueError("   \n\n"), "ValueError"),
    (ValueError("\n  while parsing\nline 2"), "while parsing"),
    (OSError(28, "No space left on device"), "[Errno 28] No space left on device"),
])
def test_first_line(error, line):
    assert first_line(error) == line


def test_first_line_is_cut_at_the_limit():
    assert first_line(RuntimeError("x" * 500)) == "x" * 200
    assert first_line(RuntimeError("abcdef"), limit=3) == "abc"


def test_an_empty_internal_error_is_one_line(capsys):
    @user_errors
    def command():
        raise AssertionError()  # no message, as a bare `assert` in a library raises

    with pytest.raises(typer.Exit):
        command()
    assert capsys.readouterr().err == ("error: AssertionError (internal error; rerun with VITCONVERT_DEBUG=1 for "
                                       "the traceback)\n")


def test_a_loader_worker_error_keeps_the_workers_last_line_not_its_traceback():
    # what torch's ExceptionWrapper.reraise() raises in the main process
    caught = ValueError("Caught ValueError in DataLoader worker process 3.\nOriginal Traceback (most recent call "
                        "last):\n  File \"x.py\", line 1, in f\n    raise ValueError(msg)\nValueError: bits must be "
                        "between or equal to 1 and 8\n")
    assert summary(caught) == "ValueError: bits must be between or equal to 1 and 8 (in DataLoader worker process 3)"
    mine = VitconvertError("Caught VitconvertError in DataLoader worker process 0.\nOriginal Traceback (most "
                           "recent call last):\n  ...\nvitconvert.errors.VitconvertError: bad image\n")
    assert summary(mine, internal=False) == "bad image (in DataLoader worker process 0)"
    assert summary(VitconvertError("plain")) == "VitconvertError: plain"
