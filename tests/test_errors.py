"""One line for any exception: the first line of its message, its type when the message is empty."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import typer

from vitconvert import errors as vitconvert_errors
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


FLAG = re.compile(r"(?<![\w-])--[a-z]")


def raised_flags(path: Path) -> list[str]:
    """``line: text`` for every string in a raise statement of ``path`` that spells a command-line flag."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for part in ast.walk(node.exc):
                if isinstance(part, ast.Constant) and isinstance(part.value, str) and FLAG.search(part.value):
                    found.append(f"{node.lineno}: {part.value.strip()[:80]}")
    return found


def test_library_errors_name_parameters_not_flags():
    """Only cli/ knows the command line: the library raises BadValue(name, ...) or mentions param(name), and the
    CLI shows the flag. A Python caller never reads `--img-size`."""
    package = Path(vitconvert_errors.__file__).parent
    offenders = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("cli/"):
            continue
        if hits := raised_flags(path):
            offenders[rel] = hits
    assert not offenders, offenders


def test_parameter_mentions_read_as_arguments_in_python_and_as_flags_on_the_cli():
    from vitconvert.cli.common import for_cli
    from vitconvert.errors import VitconvertError, param, setting

    inner = VitconvertError(f"no weights; use {param('pretrained', False)} or {param('arch', 'NAME')}")
    outer = VitconvertError(f"cannot load the teacher: {inner}; name it with {param('teacher')}")
    assert str(outer) == "cannot load the teacher: no weights; use pretrained=False or arch=NAME; name it with teacher"
    assert for_cli(f"{outer}") == ("cannot load the teacher: no weights; use --no-pretrained or --arch NAME; name it "
                                   "with --teacher")
    assert for_cli(f"{VitconvertError(param('force', True))}") == "--force"
    assert for_cli(f"{VitconvertError(param('options', 'eps=1'))}") == "--option eps=1"  # as BadValue('options')
    recipe = VitconvertError(f"resume with {setting('clip_grad', 1.0)}")
    assert str(recipe) == "resume with clip_grad=1.0 in the recipe"
    assert for_cli(f"{recipe}") == "resume with --set clip_grad=1.0"


def test_a_stop_message_names_flags_on_the_cli(capsys):
    from vitconvert.errors import Stopped, param

    @user_errors
    def command():
        raise Stopped(f"stopped by SIGTERM; continue with {param('resume', True)}", "SIGTERM")

    with pytest.raises(typer.Exit) as stopped:
        command()
    assert stopped.value.exit_code == 143 and capsys.readouterr().err == "stopped by SIGTERM; continue with --resume\n"


def test_plural_counts_as_a_sentence_does():
    from vitconvert.errors import plural

    assert [plural(n, "epoch") for n in (0, 1, 2)] == ["0 epochs", "1 epoch", "2 epochs"]
    assert [plural(n, "class", "classes") for n in (1, 3)] == ["1 class", "3 classes"]
