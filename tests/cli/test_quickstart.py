"""``vitconvert quickstart`` through typer's CliRunner: one tiny variant end to end, and its bad input."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from vitconvert.cli import app
from vitconvert.cli.quickstart import results_table

runner = CliRunner()


def assert_one_line_error(result, text: str) -> None:
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], result.stderr


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One epoch of relu, distilled and from scratch: the JSON the command printed and its --out."""
    out = tmp_path_factory.mktemp("qs") / "runs"
    result = runner.invoke(app, ["quickstart", "--variants", "relu", "--epochs", "1", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out


def test_json_has_teacher_student_and_scratch(quick):
    data, out = quick
    assert data["epochs"] == 1 and set(data) >= {"teacher", "students", "scratch", "seconds", "beats_scratch"}
    assert data["teacher"]["kind"] == "teacher" and data["teacher"]["top1"] > 0.9
    (student,), (scratch,) = data["students"], data["scratch"]
    assert (student["variant"], scratch["variant"], scratch["name"]) == ("relu", "relu", "relu-scratch")
    for row in (student, scratch):
        assert 0.0 <= row["top1"] <= row["top5"] <= 1.0 and row["seconds"] > 0
    assert data["beats_scratch"] == {"relu": student["top1"] > scratch["top1"]}
    assert (out / "relu" / "model.safetensors").is_file() and (out / "init" / "relu-scratch").is_dir()


def test_table_lists_teacher_students_scratch_and_gap(quick):
    data, _ = quick
    console = Console(width=120, record=True)
    console.print(results_table(data))
    text = console.export_text()
    gap = 100 * (data["students"][0]["top1"] - data["scratch"][0]["top1"])
    for expected in ("teacher", "relu scratch", f"{100 * data['teacher']['top1']:.2f}%", f"{gap:+.2f} pt"):
        assert expected in text


def test_refuses_to_overwrite_without_force(quick):
    _, out = quick
    result = runner.invoke(app, ["quickstart", "--variants", "relu", "--epochs", "1", "--out", str(out)])
    assert_one_line_error(result, "already exists and is not empty; use --force")


@pytest.mark.parametrize("args, text", [
    (["--variants", "elu,linformer"], "unknown variant(s) linformer"),
    (["--variants", ","], "--variants is empty"),
    (["--epochs", "0"], "epochs must be at least 1"),
])
def test_bad_input_is_one_line(tmp_path, args, text):
    assert_one_line_error(runner.invoke(app, ["quickstart", "--out", str(tmp_path / "q"), *args]), text)
