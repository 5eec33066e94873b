"""What an output may replace: the first half of the writer rule (writer.py does the writing).

An existing output is replaced only when vitconvert wrote it (a model folder whose config.json has the
"vitconvert" block, a run folder: recipe.yaml beside only what ``distill`` writes, or a run's checkpoint-last/;
a plot or export file carrying vitconvert's mark, ``written_file``) and ``force`` is given; it must never be,
contain or lie inside one of the command's inputs. Anything else is refused with one line, whatever the
arguments. A file output must end in its format's suffix (.png, .onnx, .pt2).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Union

from .errors import BadValue, VitconvertError, param
from .version import __version__

PathLike = Union[str, os.PathLike]
# What a distill run folder holds (runfolder.py, trainer.py, monitor.py, final_compare.py).
RUN_ENTRIES = frozenset({"recipe.yaml", "metrics.jsonl", "checkpoint-last", "best", "curves.png", "compare.json",
                         "compare.png", "config.json", "model.safetensors", "README.md"})


# -- what may be replaced -------------------------------------------------------------------------------
def written_by_vitconvert(path: Path) -> bool:
    """A vitconvert model folder (config.json with a "vitconvert" block) or a distill run folder."""
    if not path.is_dir():
        return False
    try:
        config = json.loads((path / "config.json").read_text())
        if isinstance(config, dict) and isinstance(config.get("vitconvert"), dict):
            return True
    except (OSError, ValueError):
        pass
    return is_run_folder(path) or (path.name == "checkpoint-last" and (path / "trainer.json").is_file())


def is_run_folder(path: Path) -> bool:
    """recipe.yaml beside nothing but what ``distill`` writes (a run in progress has no config.json yet)."""
    try:
        names = {p.name for p in path.iterdir()}
    except OSError:
        return False
    return "recipe.yaml" in names and all(n in RUN_ENTRIES or n.startswith(".") for n in names)


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_output(out: PathLike, force: bool = False, inputs: Iterable[PathLike] = (), name: str = "out",
                 replace_ok: bool = False) -> Path:
    """Raise a one-line VitconvertError unless ``out`` may be written; returns it.

    ``inputs`` are the paths the command reads (local ones; other specs are ignored). ``replace_ok``: the
    caller may replace ``out`` even without ``force`` (a run folder that only holds a failed run's recipe).
    ``name``: the caller's parameter that gave ``out``, as messages mention it (``errors.param``).
    """
    out = Path(out).expanduser()
    if str(out) in ("", "."):
        raise VitconvertError(f"{param(name, repr(str(out)))} names the current directory: give a new folder name")
    target = out.resolve()
    if target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
        raise VitconvertError(f"{param(name, out)} is the current directory (or holds it): give a new folder name")
    for parent in reversed(target.parents):
        if parent.exists() and not parent.is_dir():
            raise VitconvertError(f"cannot write {out}: {parent} is a file, not a folder")
    for given in inputs:
        path = Path(os.fspath(given).removeprefix("local-dir:")).expanduser()
        if not path.exists():
            continue
        source = path.resolve()
        if _overlap(target, source):
            where = ("is" if target == source else "contains" if target in source.parents else "is inside")
            raise VitconvertError(f"{param(name, out)} {where} the input {given}: it would be overwritten; "
                                  "choose another output folder")
    if not out.exists() and not out.is_symlink():
        return out
    if not out.is_dir():
        raise VitconvertError(f"{out} exists and is not a folder: choose another {param(name)}")
    if not written_by_vitconvert(out):
        raise VitconvertError(f"{out} exists and was not written by vitconvert (no config.json with a 'vitconvert' "
                              f"block, not a run folder): refusing to replace it, even with {param('force', True)}; "
                              f"choose another {param(name)} or remove it yourself")
    if not (force or replace_ok):
        raise VitconvertError(f"{out} already exists; use {param('force', True)} to overwrite it")
    return out


def check_container(out: PathLike, name: str = "out") -> None:
    """A folder of outputs (quickstart's ``out``): vitconvert may write into it only if everything already there
    is its own (model and run folders, or folders of them), so ``force`` never touches a user's files."""
    out = Path(out)

    def ours(path: Path, depth: int) -> bool:
        if path.name.startswith(".") or written_by_vitconvert(path):
            return True
        return path.is_dir() and depth > 0 and all(ours(p, depth - 1) for p in path.iterdir())

    if out.exists() and not out.is_dir():
        raise VitconvertError(f"{out} exists and is not a folder: choose another {param(name)}")
    if written_by_vitconvert(out):
        raise VitconvertError(f"{out} is a vitconvert model or run folder: this command writes a folder of several "
                              f"models and runs, not one; choose another {param(name)}")
    if out.is_dir() and not all(ours(p, 1) for p in out.iterdir()):
        raise VitconvertError(f"{out} holds files vitconvert did not write: refusing to write into it, even with "
                              f"{param('force', True)}; choose another {param(name)}")


# -- single files: plots and exports ------------------------------------------------------------------
# What each file vitconvert writes is, and the mark it leaves in it, so that ``force`` replaces only such a file.
FILE_KINDS = {".png": "a PNG figure", ".onnx": "an ONNX model", ".pt2": "a torch.export program"}
MARK = "vitconvert"
PNG_METADATA = {"Software": f"{MARK} {__version__}"}  # savefig(metadata=...): a PNG tEXt chunk


def written_file(path: Path) -> bool:
    """A plot or export vitconvert wrote: a PNG whose Software text is vitconvert's, an ONNX model with a
    ``vitconvert`` metadata property, a .pt2 archive with a ``vitconvert`` extra file."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".png":
            with open(path, "rb") as fh:
                head = fh.read(1 << 16)
            return head.startswith(b"\x89PNG") and b"Software\x00" + MARK.encode() in head
        if suffix == ".pt2":
            import zipfile

            with zipfile.ZipFile(path) as archive:
                return any(n.endswith(f"extra/{MARK}") for n in archive.namelist())
        if suffix == ".onnx":
            import onnx

            model = onnx.load(str(path), load_external_data=False)
            return any(p.key == MARK for p in model.metadata_props)
    except Exception:  # unreadable, another format, a missing package: not one we can vouch for
        return False
    return False


def check_file(out: PathLike, force: bool = False, inputs: Iterable[PathLike] = (), name: str = "out",
               suffix: str = ".png") -> Path:
    """Raise unless the single file ``out`` may be written; return it (``~`` expanded).

    It must end in ``suffix``, not be a folder, lie below folders, and neither be nor lie inside an input.
    An existing file is replaced only when vitconvert wrote it (``written_file``) and ``force`` is given.
    Errors about the value are ``BadValue(name, ...)``: the CLI names its flag."""
    given = os.fspath(out)
    out = Path(given).expanduser()
    kind = FILE_KINDS.get(suffix, "the file")
    if given.strip() in ("", ".") or out.is_dir():
        raise BadValue(name, f"{given or repr(given)} is a folder: give a file name ending in {suffix}")
    if out.suffix.lower() != suffix:
        raise BadValue(name, f"{given} does not end in {suffix}: {kind} is written here; give a file name ending "
                             f"in {suffix}")
    target = out.resolve()
    for parent in reversed(target.parents):
        if parent.exists() and not parent.is_dir():
            raise BadValue(name, f"cannot write {given}: {parent} is a file, not a folder")
    for source in filter(None, inputs):
        path = Path(os.fspath(source).removeprefix("local-dir:")).expanduser()
        if path.exists() and _overlap(target, path.resolve()):
            where = "is" if target == path.resolve() else "is inside"
            raise BadValue(name, f"{given} {where} the input {source}: it would change it; choose another file")
    if out.exists() or out.is_symlink():
        if not written_file(out):
            raise BadValue(name, f"{given} exists and was not written by vitconvert (not {kind} it marked): "
                                 f"refusing to replace it, even with {param('force', True)}; choose another file or "
                                 "remove it yourself")
        if not force:
            raise VitconvertError(f"{given} already exists; use {param('force', True)} to overwrite it")
    return out
