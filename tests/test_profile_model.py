"""The benchmark scripts a GPU session runs first (profile_model.py) and the CPU memory measure, dry-run here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_model.py"


def load_script():
    return load_benchmark("profile_model")


def test_each_model_gets_its_time_against_softmax_and_a_profile(capsys, one_thread):
    script = load_script()
    code = script.main(["--device", "cpu", "--model", "test_vit", "--img-size", "32", "--batch", "2",
                        "--calls", "1", "--rows", "3", "--variants", "softmax,mhla", "--train"])
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(r"^softmax: [\d.]+ ms/step", out, re.M), out
    assert re.search(r"^mhla: [\d.]+ ms/step \(wall, unprofiled\) \([\d.]+× softmax\)", out, re.M), out
    assert out.count("Self CPU time total") == 2  # one profile table per model


@pytest.mark.parametrize("argv,message", [
    (["--device", "cpu", "--variants", "softmax,nope"], "unknown variant 'nope'"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    assert load_script().main(argv) == 2
    assert message in capsys.readouterr().err


def test_saved_memory_reports_each_variant_against_softmax(capsys):
    """benchmarks/saved_memory.py: the training-memory numbers of docs/performance.md, on the CPU."""
    from vitconvert.attention.ops import dispatch

    script = load_benchmark("saved_memory")
    devices = dispatch.current().devices
    assert script.main(["--model", "test_vit", "--img-size", "32", "--depth", "1", "--batch", "1",
                        "--variants", "elu,mhla"]) == 0
    assert dispatch.current().devices == devices  # the interpreter's device is not left on for the rest of the process
    out = capsys.readouterr().out
    assert re.search(r"softmax +[\d.]+ MiB", out) and re.search(r"elu +[\d.]+ MiB +1\.00× softmax", out), out
    assert re.search(r"mhla +[\d.]+ MiB +[\d.]+× softmax", out), out
