"""`vitconvert distill`'s recipe keys given twice, as a flag and as --set: one rule, refused in one line (a --set
value beside its flag was dropped unread, even one that is no number)."""

from __future__ import annotations

import pytest
from helpers import assert_one_line_error, invoke


@pytest.mark.parametrize(("pair", "flag", "value"), [
    ("epochs=abc", "--epochs", "2"),  # the case of the sweep: the bad value was never read
    ("lr=0.1", "--lr", "0.2"),  # two good values: which one would win is no guess for the user to make
    ("batch_size=8", "--batch-size", "8"),  # the same value twice is still twice
    ("schedule.epochs=3", "--epochs", "2"),  # the dotted form names the same field
    ("optimization.batch_size=8", "--batch-size", "8"),
])
def test_a_key_given_by_set_and_by_its_flag_is_refused(tmp_path, monkeypatch, pair, flag, value):
    monkeypatch.chdir(tmp_path)
    key = pair.partition("=")[0].rpartition(".")[2]
    result = invoke("distill", "nope", "--data", "digits", "--set", pair, flag, value, "--out", "r")
    assert_one_line_error(result, f"error: --set {pair} and {flag} both set the recipe's {key}: give it once")
    assert list(tmp_path.iterdir()) == []


def test_set_alone_is_still_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke("distill", "nope", "--data", "digits", "--set", "epochs=abc", "--out", "r"),
                          "epochs")


@pytest.mark.parametrize("pair,message", [
    ("schedule.epochs=abc", "error: recipe epochs: expected int, got 'abc'"),
    ("schedule.epoch=3", "error: unknown recipe key schedule.epoch; did you mean epochs?"),
    ("shedule.epochs=3", "error: unknown recipe key 'shedule.epochs'; did you mean schedule?"),
])
def test_dotted_set_keys_are_read_and_checked(tmp_path, monkeypatch, pair, message):
    monkeypatch.chdir(tmp_path)
    result = invoke("distill", "nope", "--data", "digits", "--set", pair, "--out", "r")
    assert_one_line_error(result, message)
    assert list(tmp_path.iterdir()) == []
