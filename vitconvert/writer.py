"""The one rule every vitconvert writer follows: what it may replace, and how it writes.

- An existing output is replaced only when vitconvert wrote it (a model folder whose config.json has the
  "vitconvert" block, a run folder: recipe.yaml beside only what ``distill`` writes, or a run's
  checkpoint-last/; a plot or export file carrying vitconvert's mark, ``written_file``) and ``--force`` is
  given; it must never be, contain or lie inside one of the command's inputs. Anything else is refused with
  one line, whatever the flags. A file output must end in its format's suffix (.png, .onnx, .pt2).
- One vitconvert process at a time writes an output: ``output_lock`` holds ``.NAME.lock`` beside it from
  before the work until the output is in place, so two commands given the same new output never mix.
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
from typing import Optional, Union

from .errors import BadValue, VitconvertError, disk_full
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
    with output_lock(out):
        out = check_output(out, force=force, inputs=inputs, flag=flag)  # as it is now that no one else writes it
        try:
            remove_stale_siblings(out)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{_tag()}-", dir=out.parent))
        except OSError as e:
            raise writable_error(out, e) from None
        try:
            try:
                yield tmp
            except Exception as e:  # a library's own error type for a full disk (safetensors' SafetensorError)
                if disk_full(e) and not isinstance(e, OSError):
                    raise VitconvertError(f"cannot write {out}: No space left on device (in "
                                          f"{out.parent.resolve()})") from None
                raise
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


# -- single files: plots and exports ------------------------------------------------------------------
# What each file vitconvert writes is, and the mark it leaves in it, so that --force replaces only such a file.
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
                                 "refusing to replace it, even with --force; choose another file or remove it "
                                 "yourself")
        if not force:
            raise VitconvertError(f"{given} already exists; use --force to overwrite it")
    return out


_HELD: set[str] = set()  # outputs this process has locked (a nested lock of the same output is a no-op)


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p ``folder``; the folders it created, outermost first."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


def _lock_holder(lock: Path) -> Optional[tuple[str, int]]:
    try:
        host, pid = lock.read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


@contextmanager
def output_lock(out: PathLike) -> Iterator[None]:
    """One vitconvert process at a time per output: ``.NAME.lock`` beside it, created exclusively (O_EXCL) and
    removed at the end; one left by a killed process on this host is taken over. Creating it is also the first
    write, so a read-only or full place is refused before the work. Folders it had to create and that stay
    empty are removed again."""
    out = Path(os.fspath(out)).expanduser()
    key = os.path.abspath(out)
    if key in _HELD:
        yield
        return
    lock = out.parent / f".{out.name}.lock"
    host, pid = _tag().rsplit("-", 1)
    try:
        created = _make_parents(out.parent)
    except OSError as e:
        raise writable_error(out, e) from None
    try:
        for attempt in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666 & ~umask())
            except FileExistsError:
                holder = _lock_holder(lock)
                if holder and holder[0] == host and not _alive(holder[1]) and attempt == 0:
                    lock.unlink(missing_ok=True)  # its writer was killed
                    continue
                who = f"pid {holder[1]} on {holder[0]}" if holder else "another process"
                raise VitconvertError(f"{out} is being written by another vitconvert command ({who}): wait for it "
                                      f"to finish or write elsewhere (a lock left by a crash on another host: "
                                      f"remove {lock})") from None
            with os.fdopen(fd, "w") as fh:
                fh.write(f"{host} {pid}\n")
            break
    except OSError as e:
        _remove_empty(created)
        raise writable_error(out, e) from None
    except BaseException:
        _remove_empty(created)
        raise
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        lock.unlink(missing_ok=True)
        _remove_empty(created)


@contextmanager
def atomic_file(out: PathLike, force: bool = False, inputs: Iterable[PathLike] = (), name: str = "out",
                suffix: str = ".png") -> Iterator[Path]:
    """Yield a temporary sibling path for a single-file output (a plot, an exported .onnx); on success it
    becomes ``out``, on failure it vanishes. ``check_file``'s rules, under ``output_lock``; a new file is
    created exclusively (a hard link), so a file that appeared meanwhile is never replaced without ``force``."""
    out = check_file(out, force=force, inputs=inputs, name=name, suffix=suffix)
    replacing = out.exists()
    with output_lock(out):
        try:
            remove_stale_siblings(out)
            fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.tmp-{_tag()}-", dir=out.parent)
            os.close(fd)
        except OSError as e:
            raise writable_error(out, e) from None
        tmp = Path(tmp_name)
        try:
            yield tmp
            apply_umask(tmp)
            if replacing:
                os.replace(tmp, out)
            else:
                try:
                    os.link(tmp, out)
                except FileExistsError:
                    raise VitconvertError(f"{out} appeared while this command ran (another program wrote it): "
                                          "not replaced") from None
                except OSError:  # no hard links here: the check above and the lock must do
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
