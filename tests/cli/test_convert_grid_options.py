"""`vitconvert convert --to mhla --option ...` with options that fit no layer on the model's patch grid: refused
in one line before anything is built or written (blocks_per_side=100 on a 4×4 grid wrote a 1.5 GB folder)."""

from __future__ import annotations

import pytest
from distill.helpers import make_teacher
from helpers import assert_one_line_error, invoke


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return make_teacher(tmp_path_factory.mktemp("grid") / "teacher")  # 32 px, patch 8: a 4×4 grid


@pytest.mark.parametrize(("option", "message"), [
    ("blocks_per_side=100", "mhla's blocks_per_side 100 gives more blocks than the 4×4 patch grid has tokens per "
                            "side: a block holds at least one token; at most [4, 4] here"),
    ("blocks_per_side=[2,5]", "mhla's blocks_per_side [2, 5] gives more blocks"),
    ("lepe_kernel=99", "mhla's lepe_kernel 99 is wider than the 4×4 patch grid: its outer taps never touch a token; "
                       "at most 7 here (odd, or 0 for no LePE)"),
    ("lepe_kernel=9", "at most 7 here"),
])
def test_options_that_fit_no_grid_are_refused(teacher, tmp_path, monkeypatch, option, message):
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", teacher, "--to", "mhla", "--option", option, "--out", "m")
    assert_one_line_error(result, message)
    assert result.stderr.startswith("error: --option: mhla's ")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("option", ["blocks_per_side=4", "blocks_per_side=[1,4]", "lepe_kernel=7", "lepe_kernel=0",
                                    "block_side=100"])
def test_options_at_the_grid_s_limits_convert(teacher, tmp_path, monkeypatch, option):
    """The widest that fit: one token per block, taps reaching the far edge; a block side past the grid is one
    block, not a refusal."""
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", teacher, "--to", "mhla", "--option", option, "--out", "m")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m" / "model.safetensors").is_file()
