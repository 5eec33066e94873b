"""The one rule every vitconvert writer follows: what it may replace, and how it writes.

- An existing output is replaced only when vitconvert wrote it (a model folder whose config.json has the
  "vitconvert" block, a run folder: recipe.yaml beside only what ``distill`` writes, or a run's
  checkpoint-last/) and ``--force`` is
  given; it must never be, contain or lie inside one of the command's inputs. Anything else is refused with
  one line, whatever the flags.
- Writes go to a temporary sibling ``.NAME.tmp-HOST-PID-XXXX`` renamed over the target when complete, so
  the old output survives until the new one is whole. The host and PID in the name let a later run remove
  the siblings a killed run left behind, and never one that a live process is still writing.
- Folders and files get the process umask, like any file the user writes (not a temporary file's 0700/0600).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Union

from .errors import VitconvertError

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


def check_output(out: PathLike, force: bool = False, inputs: Iterable[PathLike] = (), flag: str = "--out",
                 replace_ok: bool = False) -> Path:
    """Raise a one-line VitconvertError unless ``out`` may be written; returns it.

    ``inputs`` are the paths the command reads (local ones; other specs are ignored). ``replace_ok``: the
    caller may replace ``out`` even without ``force`` (a run folder that only holds a failed run's recipe).
    """
    out = Path(out).expanduser()
    if str(out) in ("", "."):
        raise VitconvertError(f"{flag} {str(out)!r} names the current directory: give a new folder name")
    target = out.resolve()
    if target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
        raise VitconvertError(f"{flag} {out} is the current directory (or holds it): give a new folder name")
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
            raise VitconvertError(f"{flag} {out} {where} the input {given}: it would be overwritten; "
                                  "choose another output folder")
    if not out.exists() and not out.is_symlink():
        return out
    if not out.is_dir():
        raise VitconvertError(f"{out} exists and is not a folder: choose another {flag}")
    if not written_by_vitconvert(out):
        raise VitconvertError(f"{out} exists and was not written by vitconvert (no config.json with a 'vitconvert' "
                              f"block, not a run folder): refusing to replace it, even with --force; choose "
                              f"another {flag} or remove it yourself")
    if not (force or replace_ok):
        raise VitconvertError(f"{out} already exists; use --force to overwrite it")
    return out


def check_container(out: PathLike, flag: str = "--out") -> None:
    """A folder of outputs (quickstart's --out): vitconvert may write into it only if everything already there
    is its own (model and run folders, or folders of them), so --force never touches a user's files."""
    out = Path(out)

    def ours(path: Path, depth: int) -> bool:
        if path.name.startswith(".") or written_by_vitconvert(path):
            return True
        return path.is_dir() and depth > 0 and all(ours(p, depth - 1) for p in path.iterdir())

    if out.exists() and not out.is_dir():
        raise VitconvertError(f"{out} exists and is not a folder: choose another {flag}")
    if out.is_dir() and not all(ours(p, 1) for p in out.iterdir()):
        raise VitconvertError(f"{out} holds files vitconvert did not write: refusing to write into it, even with "
                              f"--force; choose another {flag}")


# -- how it is written ----------------------------------------------------------------------------------
def umask() -> int:
    """The process umask, read without changing it where Linux says it (/proc), else by a set-and-restore."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """Give ``path`` and everything under it the modes a plain mkdir/open would have (0777/0666 & ~umask)."""
    mask = umask()
    dirs, files = 0o777 & ~mask, 0o666 & ~mask
    os.chmod(path, dirs if path.is_dir() else files)
    if path.is_dir():
        for root, subdirs, names in os.walk(path):
            for d in subdirs:
                os.chmod(os.path.join(root, d), dirs)
            for n in names:
                os.chmod(os.path.join(root, n), files)


def _tag() -> str:
    host = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:32] or "host"
    return f"{host}-{os.getpid()}"


STALE = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)(?:-.*)?$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_siblings(out: Path) -> list[Path]:
    """Delete ``.NAME.tmp-HOST-PID-*`` / ``.NAME.old-HOST-PID`` siblings of ``out`` left by a killed writer on
    this host; a sibling whose writer is still running (or on another host) is left alone."""
    host = _tag().rsplit("-", 1)[0]
    removed = []
    try:
        siblings = list(out.parent.iterdir())
    except OSError:
        return removed
    for sib in siblings:
        m = STALE.match(sib.name)
        if not m or m["name"] != out.name or m["host"] != host or _alive(int(m["pid"])):
            continue
        shutil.rmtree(sib, ignore_errors=True) if sib.is_dir() else sib.unlink(missing_ok=True)
        removed.append(sib)
    return removed


def writable_error(out: Path, e: OSError) -> VitconvertError:
    reason = e.strerror or str(e) or type(e).__name__
    return VitconvertError(f"cannot write {out}: {reason} (in {out.parent.resolve()})")


@contextmanager
def atomic_folder(out: PathLike, force: bool = False, inputs: Iterable[PathLike] = (),
                  flag: str = "--out") -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; on success it replaces ``out``, on failure it vanishes.

    ``out`` must pass ``check_output``; the old folder is moved aside only once the new one is complete.
    """
    out = check_output(out, force=force, inputs=inputs, flag=flag)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_siblings(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{_tag()}-", dir=out.parent))
    except OSError as e:
        raise writable_error(out, e) from None
    try:
        yield tmp
        apply_umask(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{_tag()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except OSError as e:
        raise writable_error(out, e) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_file(out: PathLike, force: bool = False, inputs: Iterable[PathLike] = (),
                flag: str = "--out") -> Iterator[Path]:
    """Yield a temporary sibling path for a single-file output (a plot, an exported .onnx); on success it
    replaces ``out`` (only with ``force``, never an input or a folder), on failure it vanishes."""
    out = Path(out).expanduser()
    if out.is_dir():
        raise VitconvertError(f"{out} is a folder: {flag} names a file here")
    if out.exists() and not force:
        raise VitconvertError(f"{out} already exists; use --force to overwrite it")
    if out.exists():  # check_output's input and parent rules, for a file that may be replaced
        check_output(out.parent / f".{out.name}.check", inputs=inputs, flag=flag)
        if any(Path(os.fspath(i)).expanduser().resolve() == out.resolve() for i in inputs):
            raise VitconvertError(f"{flag} {out} is the input {out}: choose another output file")
    else:
        check_output(out, inputs=inputs, flag=flag)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_siblings(out)
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.tmp-{_tag()}-", dir=out.parent)
        os.close(fd)
    except OSError as e:
        raise writable_error(out, e) from None
    tmp = Path(name)
    try:
        yield tmp
        apply_umask(tmp)
        os.replace(tmp, out)
    except OSError as e:
        raise writable_error(out, e) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """A temporary sibling, then os.replace: readers see the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        apply_umask(Path(tmp))  # a plain file's mode, not mkstemp's 0600
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
