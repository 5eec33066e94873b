"""The CLI's shared parsing and error mapping."""

from __future__ import annotations

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
