"""One home per fact (docs/style.md's habits), checked on the source: a message, an attribute, an environment
variable each written in one module, so changing it is one edit and no copy drifts (issue 40)."""

from __future__ import annotations

from pathlib import Path

import vitconvert

PACKAGE = Path(vitconvert.__file__).parent


def files_saying(text: str) -> list[str]:
    """The package's modules whose source holds ``text``, relative to the package."""
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if text in p.read_text())


def test_the_corrupt_file_line_is_built_in_one_place():
    assert files_saying("corrupt or truncated") == ["errors.py"]


def test_the_models_record_is_named_in_one_module():
    assert files_saying('"vitconvert_report"') == ["provenance.py"]
    assert files_saying(".vitconvert_report") == []


def test_a_copy_of_a_loaded_model_saves_with_its_source(tmp_path):
    """The record travels with the model: load, copy (as a fine-tune script or distill's export copy does), save;
    the new folder still names the source, so distill and compare can rebuild the teacher from it."""
    import copy
    import json

    from distill.helpers import make_student

    folder = make_student(tmp_path)
    copied = copy.deepcopy(vitconvert.load(folder))
    vitconvert.save(copied, tmp_path / "copy")
    written, original = (json.loads((f / "config.json").read_text())["vitconvert"] for f in (tmp_path / "copy", folder))
    assert written["source"] == original["source"] and written["init"] == original["init"]


def test_torchruns_variables_are_read_only_by_the_launcher():
    """WORLD_SIZE, RANK and LOCAL_RANK are read and checked together in distributed.launcher (a stray RANK=3
    beside WORLD_SIZE=1 is refused there); a module reading one by hand would skip that check."""
    import ast

    names = {"WORLD_SIZE", "RANK", "LOCAL_RANK"}
    readers = sorted({p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                      for node in ast.walk(ast.parse(p.read_text()))
                      if isinstance(node, ast.Constant) and node.value in names})
    assert readers == ["distributed.py"]


def test_the_hub_cache_is_asked_for_weights_in_one_function():
    """hub_io.cached_weights answers "are this repo's weights here?" for every caller (model threads, a timm name's
    reachability, the mark check): a second lookup had drifted (safetensors only, or a bool of either file)."""
    assert files_saying("try_to_load_from_cache") == ["hub_io.py"]
