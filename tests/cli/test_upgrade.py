"""``vitconvert upgrade``: what it refuses, each as one line, leaving the folder as it was (the format-1 and
format-2 rewrites themselves: tests/test_old_folders.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from helpers import assert_one_line_error, image_batch, invoke, place_in_hub_cache, tiny_model

import vitconvert
from vitconvert.errors import VitconvertError

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
    "a Hub repo": (lambda tmp: "hf-hub:me/old", "is a Hub repo: upgrade rewrites a folder of your own in place"),
    "truncated weights": (truncated, "corrupt or truncated"),
    "a Hub cache snapshot": (in_hub_cache, "is a snapshot in the Hub cache: upgrade a copy"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_upgrade_refuses_in_one_line_and_changes_nothing(tmp_path, case):
    make, message = CASES[case]
    folder = make(tmp_path)
    before = digest(folder) if Path(folder).is_dir() else None
    assert_one_line_error(invoke("upgrade", folder), message)
    assert (digest(folder) if Path(folder).is_dir() else None) == before


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


def format_version(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["vitconvert"]["format_version"]


def test_a_student_saved_by_timm_becomes_a_full_vitconvert_folder(tmp_path):
    """timm's save_for_hf writes no vitconvert block (info: variant None, push: refused); upgrade adds it."""
    folder = timm_saved_student(tmp_path)
    assert "vitconvert upgrade" in assert_one_line_error_text(invoke("push", folder, "--repo", "me/x", "--dry-run"))
    result = invoke("upgrade", folder, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"folder": str(folder.resolve()), "upgraded": True, "from_format": None,
                                         "saved_by": "timm"}
    config = json.loads((folder / "config.json").read_text())
    assert config["vitconvert"]["variant"] == "elu" and config["vitconvert"]["upgraded_from"] == {"saved_by": "timm"}
    assert "num_classes" not in config["model_args"]
    card = (folder / "README.md").read_text()  # what it is: not a fresh conversion, and nothing it cannot know
    assert "Saved by timm's own tools" in card and "not yet trained" not in card and "`?`" not in card
    assert json.loads(invoke("info", folder, "--json").stdout)["variant"] == "elu"
    assert json.loads(invoke("upgrade", folder, "--json").stdout)["upgraded"] is False


def test_a_student_saved_with_timms_default_pickle_is_upgraded_through_its_tensors(tmp_path):
    """save_for_hf's default writes pytorch_model.bin: push says to upgrade, load names upgrade, and upgrade
    reads the tensors (weights_only, never unpickled) into a full folder with the same model."""
    import torch
    from timm.models import save_for_hf

    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    folder = tmp_path / "timm-saved"
    save_for_hf(student, str(folder))  # timm's default: torch's pickle format, no model.safetensors
    assert "vitconvert upgrade" in assert_one_line_error_text(invoke("push", folder, "--repo", "me/x", "--dry-run"))
    with pytest.raises(VitconvertError, match=f"upgrade {folder}` writes it"):
        vitconvert.load(folder)
    result = invoke("upgrade", folder, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["saved_by"] == "timm" and (folder / "model.safetensors").is_file()
    x = image_batch(student)
    assert torch.equal(vitconvert.load(folder)(x), student.eval()(x))
    assert invoke("push", folder, "--repo", "me/x", "--dry-run").exit_code == 0


def test_a_vitconvert_folder_holding_timms_pickle_loads_and_is_upgraded_to_safetensors(tmp_path):
    """A folder with its vitconvert block whose weights are only pytorch_model.bin (save_for_hf with
    safe_serialization=False): load reads it (weights_only, checked against the block), push names upgrade, and
    upgrade writes model.safetensors, marked, keeping the pickle (load then reads the safetensors; push leaves the
    pickle out)."""
    import torch
    from safetensors.torch import load_file

    from vitconvert.weights_file import read_mark

    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    folder = vitconvert.save(student, tmp_path / "m")
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    x = image_batch(student)
    assert torch.equal(vitconvert.load(folder)(x), student.eval()(x))
    assert "pytorch_model.bin" in invoke("info", folder).output
    refused = assert_one_line_error_text(invoke("push", folder, "--repo", "me/x", "--dry-run"))
    assert "pytorch_model.bin, which push leaves out: `vitconvert upgrade" in refused
    result = invoke("upgrade", folder)
    assert result.exit_code == 0, result.output
    assert "pytorch_model.bin written as model.safetensors (the pickle kept" in " ".join(result.output.split())
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                        "pytorch_model.bin"]
    assert read_mark(folder / "model.safetensors").variant == "elu"
    config = json.loads((folder / "config.json").read_text())["vitconvert"]
    assert config["upgraded_from"]["weights"] == "pytorch_model.bin"
    assert torch.equal(vitconvert.load(folder)(x), student(x))
    assert invoke("push", folder, "--repo", "me/x", "--dry-run").exit_code == 0
    assert json.loads(invoke("upgrade", folder, "--json").stdout)["upgraded"] is False


def test_an_upgrade_of_timms_pickle_stopped_before_config_json_is_finished_by_a_rerun(tmp_path, monkeypatch):
    """Upgrading a vitconvert folder that holds only pytorch_model.bin, stopped (Ctrl-C) after model.safetensors
    moved in but before config.json: the folder loads, and a rerun finishes the upgrade (config.json records the
    pickle it was written from) instead of saying there is nothing to do; a third run has nothing to do."""
    import os

    import torch
    from safetensors.torch import load_file

    from vitconvert import folder_upgrade as folder_module

    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    folder = vitconvert.save(student, tmp_path / "m")
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    moved, replace = [], os.replace

    def stopped_after_the_weights(src, dst):
        if moved:
            raise KeyboardInterrupt
        moved.append(Path(dst).name)
        replace(src, dst)

    monkeypatch.setattr(folder_module.os, "replace", stopped_after_the_weights)
    with pytest.raises(KeyboardInterrupt):
        folder_module.upgrade_folder(folder)
    monkeypatch.setattr(folder_module.os, "replace", replace)
    assert moved == ["model.safetensors"]
    assert "upgraded_from" not in json.loads((folder / "config.json").read_text())["vitconvert"]
    x = image_batch(student)
    assert torch.equal(vitconvert.load(folder)(x), student.eval()(x))
    result = invoke("upgrade", folder, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["upgraded"] is True
    config = json.loads((folder / "config.json").read_text())["vitconvert"]
    assert config["upgraded_from"]["weights"] == "pytorch_model.bin"
    assert torch.equal(vitconvert.load(folder)(x), student(x))
    assert json.loads(invoke("upgrade", folder, "--json").stdout)["upgraded"] is False


def assert_one_line_error_text(result) -> str:
    assert result.exit_code != 0 and len(result.stderr.strip().splitlines()) == 1, result.output
    return result.stderr


def format1_copy(tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(FORMAT1, tmp_path / "real" / "elu"))


def test_upgrade_through_a_symlink_upgrades_the_real_folder_and_keeps_the_link(tmp_path):
    real = format1_copy(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    result = invoke("upgrade", link)
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and link.resolve() == real.resolve() and format_version(real) == 2


def test_links_inside_the_folder_stay_links_and_dangling_ones_do_not_fail_it(tmp_path):
    folder = format1_copy(tmp_path)
    data = tmp_path / "dataset"
    data.mkdir()
    (data / "big.bin").write_bytes(b"x" * 1000)
    (folder / "data").symlink_to("../../dataset", target_is_directory=True)  # a linked data set, relative
    (folder / "gone").symlink_to(tmp_path / "nothing-here")  # dangling
    (folder / "notes.txt").write_text("mine\n")
    result = invoke("upgrade", folder)
    assert result.exit_code == 0, result.output
    assert format_version(folder) == 2 and (folder / "notes.txt").read_text() == "mine\n"
    assert (folder / "data").is_symlink() and (folder / "data" / "big.bin").read_bytes() == b"x" * 1000
    assert (folder / "gone").is_symlink() and not (folder / "gone").exists()
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["elu"]  # nothing left beside it


@pytest.mark.parametrize("form", [".", "local-dir:."])
def test_upgrade_of_the_current_folder_and_local_dir_spelling(tmp_path, monkeypatch, form):
    folder = format1_copy(tmp_path)
    monkeypatch.chdir(folder)
    result = invoke("upgrade", form)
    assert result.exit_code == 0 and "upgraded" in result.stdout, result.output
    assert format_version(folder) == 2 and Path.cwd().samefile(folder)  # the shell's folder is still the folder
