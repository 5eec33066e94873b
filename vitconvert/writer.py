"""The one rule every vitconvert writer follows: what it may replace (output_rules.py, re-exported here), and
how it writes.

- One vitconvert process at a time writes an output: ``output_lock`` holds an OS lock on ``.NAME.lock`` beside
  it from before the work until the output is in place, so two commands given the same new output never mix;
  the system releases it when its process dies, so a crash leaves no lock behind.
- Writes go to a temporary sibling ``.NAME.tmp-HOST-PID-XXXX`` renamed over the target when complete, so
  the old output survives until the new one is whole. The host and PID in the name let a later run remove
  the siblings a killed run left behind, and never one that a live process is still writing.
- Folders and files get the process umask, like any file the user writes (not a temporary file's 0700/0600).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from .errors import VitconvertError, disk_full
from .output_rules import (  # noqa: F401  (the rules, re-exported: writers import them from here)
    FILE_KINDS,
    MARK,
    PNG_METADATA,
    RUN_ENTRIES,
    PathLike,
    check_container,
    check_file,
    check_output,
    is_run_folder,
    written_by_vitconvert,
    written_file,
)


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
    """The one line for an output that cannot be written, naming the folder where it failed."""
    reason = e.strerror or str(e) or type(e).__name__
    return VitconvertError(f"cannot write {out}: {reason} (in {out.parent.resolve()})")


def temporary_sibling(out: Path) -> Path:
    """A new empty folder ``.NAME.tmp-HOST-PID-XXXX`` beside ``out`` (a killed run's ones removed first), or one
    line saying why it cannot be made."""
    try:
        remove_stale_siblings(out)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{_tag()}-", dir=out.parent))
    except OSError as e:
        raise writable_error(out, e) from None


@contextmanager
def atomic_folder(out: PathLike, force: bool = False, inputs: Iterable[PathLike] = (),
                  name: str = "out") -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; on success it replaces ``out``, on failure it vanishes.

    ``out`` must pass ``check_output``; the old folder is moved aside only once the new one is complete.
    """
    out = check_output(out, force=force, inputs=inputs, name=name)
    with output_lock(out):
        out = check_output(out, force=force, inputs=inputs, name=name)  # as it is now that no one else writes it
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


def _write_holder(lock: Path) -> None:
    """Say in the lock file who holds it, for the message a second writer gets (best effort: the lock is the
    flock, which closing this other descriptor does not release)."""
    host, pid = _tag().rsplit("-", 1)
    with contextlib.suppress(OSError), open(lock, "r+", encoding="utf-8") as fh:
        fh.truncate()
        fh.write(f"{host} {pid}\n")


@contextmanager
def output_lock(out: PathLike) -> Iterator[None]:
    """One vitconvert process at a time per output: an OS lock (``filelock``: flock) on ``.NAME.lock`` beside
    it, which the system releases when its process dies, on this host or another one sharing the folder, so a
    crash never leaves a lock to remove by hand. The file is removed at the end. Creating it is also the first
    write, so a read-only or full place is refused before the work. Folders it had to create and that stay empty
    are removed again."""
    from filelock import FileLock, Timeout

    out = Path(os.fspath(out)).expanduser()
    key = os.path.abspath(out)
    if key in _HELD:
        yield
        return
    path = out.parent / f".{out.name}.lock"
    try:
        created = _make_parents(out.parent)
    except OSError as e:
        raise writable_error(out, e) from None
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
        _write_holder(path)
    except Timeout:
        _remove_empty(created)
        holder = _lock_holder(path)
        who = f"pid {holder[1]} on {holder[0]}" if holder else "another process"
        raise VitconvertError(f"{out} is being written by another vitconvert command ({who}): wait for it to "
                              "finish or write elsewhere") from None
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
        try:
            path.unlink(missing_ok=True)  # while still held: filelock refuses an inode unlinked under it
        finally:
            lock.release()
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
