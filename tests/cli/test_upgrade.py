"""``vitconvert upgrade``: what it refuses, each as one line, leaving the folder as it was (the format-1 and
format-2 rewrites themselves: tests/test_old_folders.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from helpers import assert_one_line_error, invoke, place_in_hub_cache, tiny_model

import vitconvert

FORMAT1 = Path(__file__).resolve().parents[1] / "fixtures" / "format1" / "elu"


def digest(folder: Path) -> str:
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sorted(folder.iterdir()))).hexdigest()


def timm_saved_student(tmp_path: Path) -> Path:
    from timm.models import save_for_hf

    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    save_for_hf(student, str(tmp_path / "timm-saved"), safe_serialization=True)
    return tmp_path / "timm-saved"


def softmax_folder(tmp_path: Path) -> Path:
    from timm.models import save_for_hf

    save_for_hf(tiny_model("vit"), str(tmp_path / "softmax"), safe_serialization=True)
    return tmp_path / "softmax"


def truncated(tmp_path: Path) -> Path:
    import shutil

    folder = Path(shutil.copytree(FORMAT1, tmp_path / "trunc"))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return folder


def in_hub_cache(tmp_path: Path) -> Path:
    sha = place_in_hub_cache(tmp_path / "hub", "me/old", FORMAT1)
    return tmp_path / "hub" / "models--me--old" / "snapshots" / sha


CASES = {
    "missing folder": (lambda tmp: tmp / "nope", "folder not found"),
    "a file": (lambda tmp: Path(__file__), "is a file, not a model folder"),
    "a softmax timm folder": (softmax_folder, "is not a vitconvert folder"),
    "a student saved by timm's save_for_hf": (timm_saved_student, "loads as it is"),
    "truncated weights": (truncated, "corrupt or truncated"),
    "a Hub cache snapshot": (in_hub_cache, "is a snapshot in the Hub cache: upgrade a copy"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_upgrade_refuses_in_one_line_and_changes_nothing(tmp_path, case):
    make, message = CASES[case]
    folder = make(tmp_path)
    before = digest(folder) if folder.is_dir() else None
    assert_one_line_error(invoke("upgrade", folder), message)
    assert (digest(folder) if folder.is_dir() else None) == before


def test_a_command_loading_an_old_folder_names_upgrade_in_one_note_line():
    """The library warns (OldFolderWarning); the CLI shows it as one `note:` line, not Python's warning format."""
    import warnings

    from vitconvert.folder import OldFolderWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always", OldFolderWarning)  # as in a fresh process (no earlier one deduplicates it)
        result = invoke("eval", FORMAT1, "--data", "digits")  # ends in an error: 10 digit classes, a 3-class head
    lines = result.stderr.strip().splitlines()
    assert lines[0] == (f"note: {FORMAT1} is in an older vitconvert folder layout (timm and transformers read "
                        f"its format-1 config.json as a softmax model): `vitconvert upgrade {FORMAT1}` rewrites it "
                        "in place")
    assert len(lines) == 2 and lines[1].startswith("error: ")
