"""The writer rule (vitconvert/writer.py): umask modes, stale temporary siblings, what --force may replace."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import hold_lock, invoke, tiny_model

import vitconvert
from vitconvert.errors import VitconvertError
from vitconvert.writer import _tag, check_output, remove_stale_siblings

ROOT = Path(__file__).resolve().parents[1]


def modes(folder: Path) -> set[tuple[str, int]]:
    return {(str(p.relative_to(folder)), stat.S_IMODE(p.stat().st_mode)) for p in [folder, *folder.rglob("*")]}


@pytest.fixture
def umask():
    """Set the process umask for a test, then put the old one back."""
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_model_folder_gets_the_umask(tmp_path, umask, mask):
    umask(mask)
    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    vitconvert.save(student, tmp_path / "m")
    found = modes(tmp_path / "m")
    assert found == {(".", 0o777 & ~mask)} | {(n, 0o666 & ~mask) for n in
                                              ("config.json", "model.safetensors", "README.md")}


def test_run_folder_gets_the_umask(tmp_path, umask):
    from distill.helpers import FAST, make_images, make_student

    from vitconvert.distill import distill

    umask(0o022)
    student = make_student(tmp_path)
    distill(student, tmp_path / "run", overrides={**FAST, "data": str(make_images(tmp_path / "i")),
                                                                     "compare_batches": 0}, show=False)
    for name, mode in modes(tmp_path / "run"):
        expected = 0o755 if (tmp_path / "run" / name).is_dir() else 0o644
        assert mode == expected, (name, oct(mode))


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    import vitconvert.weights_file as wf
    real = wf.write_weights
    def slow(path, tensors, *a, **k):  # write the weights, then hang before the folder is complete
        real(path, tensors, *a, **k)
        print("writing", flush=True)
        time.sleep(60)
    wf.write_weights = slow
    from vitconvert.cli import main
    sys.argv = ["vitconvert", *sys.argv[1:]]
    main()
""")


def test_sigkill_mid_write_then_rerun_leaves_no_stale_sibling(tmp_path, umask, monkeypatch):
    """A convert killed while writing (a process) leaves `.m.tmp-HOST-PID-*`; the next convert of the same --out
    (typer's runner, in this process) removes it."""
    umask(0o022)
    import timm

    timm.models.save_for_hf(tiny_model("vit"), str(tmp_path / "src"), safe_serialization=True)
    args = [str(tmp_path / "src"), "--to", "elu", "--out", str(tmp_path / "m")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, "convert", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        stale = [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.tmp-")]
        assert len(stale) == 1 and f"-{proc.pid}-" in stale[0]
        # while the writer lives, its sibling is not touched by another writer of the same target
        assert remove_stale_siblings(tmp_path / "m") == [] and (tmp_path / stale[0]).exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (tmp_path / stale[0]).exists() and not (tmp_path / "m").exists()
    monkeypatch.chdir(tmp_path)
    rerun = invoke("convert", *args)
    assert rerun.exit_code == 0, rerun.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [".vitconvert", "m", "src"]
    assert modes(tmp_path / "m") == {(".", 0o755), ("config.json", 0o644), ("model.safetensors", 0o644),
                                     ("README.md", 0o644)}
    assert type(vitconvert.load(tmp_path / "m")).__name__ == "VisionTransformer"


def test_siblings_of_other_hosts_and_other_targets_stay(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = _tag().rsplit("-", 1)[0]
    keep = [tmp_path / f".m.tmp-otherhost-{dead.pid}-abc", tmp_path / f".mm.tmp-{host}-{dead.pid}-abc",
            tmp_path / f".m.tmp-{host}-{os.getpid()}-abc", tmp_path / ".m.tmp-legacyname"]
    gone = [tmp_path / f".m.tmp-{host}-{dead.pid}-abc", tmp_path / f".m.old-{host}-{dead.pid}"]
    for p in keep + gone:
        p.mkdir()
    assert sorted(remove_stale_siblings(tmp_path / "m")) == sorted(gone)
    assert all(p.exists() for p in keep)


def test_check_output_rules(tmp_path):
    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    vitconvert.save(student, tmp_path / "m")
    (tmp_path / "user").mkdir()
    assert check_output(tmp_path / "new") == tmp_path / "new"
    assert check_output(tmp_path / "m", force=True) == tmp_path / "m"
    for out, inputs, text in ((tmp_path / "m", [], "already exists"), (tmp_path / "user", [], "not written by"),
                              (tmp_path / "m", [tmp_path / "m"], "is the input"),
                              (tmp_path / "m" / "x", [tmp_path / "m"], "is inside the input"),
                              (tmp_path, [tmp_path / "m"], "contains the input")):
        with pytest.raises(VitconvertError, match=text):
            check_output(out, force=text != "already exists", inputs=inputs)
    with pytest.raises(VitconvertError, match="is the input"):  # a symlink to the input is the input
        (tmp_path / "link").symlink_to(tmp_path / "m")
        check_output(tmp_path / "link", force=True, inputs=[tmp_path / "m"])


def test_save_refuses_to_replace_the_model_it_was_loaded_from(tmp_path):
    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    vitconvert.save(student, tmp_path / "m")
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    start = time.perf_counter()
    with pytest.raises(VitconvertError, match="is the input"):
        vitconvert.save(student, tmp_path / "m", force=True, inputs=[tmp_path / "m"])
    assert time.perf_counter() - start < 1
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before


def test_atomic_file_rules(tmp_path, umask):
    from vitconvert.writer import atomic_file

    umask(0o022)
    ours = b"\x89PNG\r\n\x1a\n....tEXtSoftware\x00vitconvert 0.1.0"  # the mark savefig(metadata=PNG_METADATA) writes
    with atomic_file(tmp_path / "x.png") as tmp:
        tmp.write_bytes(ours)
    assert (tmp_path / "x.png").read_bytes() == ours and (tmp_path / "x.png").stat().st_mode & 0o777 == 0o644
    with pytest.raises(VitconvertError, match="already exists"):
        with atomic_file(tmp_path / "x.png"):
            pass
    with pytest.raises(VitconvertError, match="is the input"):
        with atomic_file(tmp_path / "x.png", force=True, inputs=[tmp_path / "x.png"]):
            pass
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "x.png", force=True) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("killed")
    assert (tmp_path / "x.png").read_bytes() == ours and sorted(p.name for p in tmp_path.iterdir()) == ["x.png"]


def test_force_replaces_only_a_file_vitconvert_marked(tmp_path):
    """--force replaces a plot or export vitconvert wrote, never a user's file of the same name or another kind."""
    from vitconvert.writer import atomic_file

    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n a user's picture")
    (tmp_path / "notes.txt").write_text("mine")
    for name, suffix, text in (("photo.png", ".png", "not written by vitconvert"),
                               ("notes.txt", ".onnx", "does not end in .onnx"),
                               ("x.pt2", ".onnx", "does not end in .onnx"), (".", ".png", "is a folder")):
        with pytest.raises(VitconvertError, match=text):
            with atomic_file(tmp_path / name, force=True, suffix=suffix) as tmp:
                tmp.write_bytes(b"new")
    assert (tmp_path / "photo.png").read_bytes().endswith(b"picture") and (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "photo.png"]


def test_output_lock_is_exclusive_and_a_killed_holders_lock_never_blocks(tmp_path):
    """The lock is the OS's: a live holder refuses a second writer; one killed (here on another host sharing the
    folder, which no pid check could see) leaves a file that no longer locks anything."""
    from vitconvert.writer import output_lock

    live = hold_lock(tmp_path / "a")
    crashed = hold_lock(tmp_path / "b", host="another_host")
    crashed.kill()
    crashed.wait()
    try:
        with pytest.raises(VitconvertError, match=f"being written by another vitconvert command \\(pid {live.pid} on"):
            with output_lock(tmp_path / "a"):
                pass
        assert (tmp_path / ".b.lock").read_text().split() == ["another_host", str(crashed.pid)]  # what it left
        with output_lock(tmp_path / "b"), output_lock(tmp_path / "b"):  # not blocked; nested: a no-op
            assert (tmp_path / ".b.lock").read_text().split() == _tag().rsplit("-", 1)
    finally:
        live.kill()
        live.wait()
    with output_lock(tmp_path / "new" / "deeper" / "c"):
        assert (tmp_path / "new" / "deeper" / ".c.lock").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.lock"]  # b's is removed; the folders made for c too
