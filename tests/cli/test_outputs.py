"""Nothing lost (issue 23): every file a command writes — plots, exports — follows the folders' rule: a new file,
or with --force one vitconvert wrote, never an input or a user's file; one writer per output at a time."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distill.helpers import FAST, make_images, make_student
from helpers import assert_one_line_error, hold_lock, invoke

REPO = Path(__file__).resolve().parents[2]
QUICK = ["--epochs", "1", "--batch-size", "4"] + [a for k, v in FAST.items() if k not in ("epochs", "batch_size")
                                                  for a in ("--set", f"{k}={json.dumps(v)}")]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("outputs")
    make_student(root)
    make_images(root / "images")
    (root / "notes.txt").write_text("the user's notes\n")
    (root / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n the user's own picture")
    (root / "afile").write_text("x")
    return root


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + (p.read_bytes() if p.is_file() else b"/"))
    return h.hexdigest()


PLOT_REFUSALS = [  # (--plot value, what the one line says); each refused before any work, nothing changed
    ("{ws}/student-elu/model.safetensors", "does not end in .png"),  # a model's weights
    ("{ws}/teacher/config.json", "does not end in .png"),
    ("{ws}/student-elu/gaps.png", "is inside the input"),  # a new file inside the student
    ("{ws}/notes.txt", "does not end in .png"),
    ("{ws}/photo.png", "not written by vitconvert"),  # a user's PNG, even with --force
    ("{ws}/images", "is a folder"),
    ("{ws}/afile/x.png", "is a file, not a folder"),
    ("/sys/vc-plot.png", "cannot write /sys/vc-plot.png"),
]


@pytest.mark.parametrize("command", ["compare", "bench"])
@pytest.mark.parametrize("plot, text", PLOT_REFUSALS, ids=[t for _, t in PLOT_REFUSALS])
def test_plot_never_replaces_what_vitconvert_did_not_write(ws, command, plot, text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = digest(ws)
    args = (["compare", ws / "student-elu", "--data", ws / "images"] if command == "compare" else
            ["bench", ws / "student-elu", "--repeats", "1", "--warmup", "0", "--no-memory"])
    start = time.perf_counter()
    result = invoke(*args, "--plot", plot.format(ws=ws), "--force")
    assert_one_line_error(result, text)
    assert "timing" not in result.stderr and time.perf_counter() - start < 5  # refused before the work
    assert digest(ws) == before and list(tmp_path.iterdir()) == []


def test_plot_writes_a_new_png_and_replaces_its_own_only_with_force(ws, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    args = ["compare", ws / "student-elu", "--data", ws / "images", "--batches", "1", "--batch-size", "2"]
    first = invoke(*args, "--plot", "~/gaps.png")  # the shell did not expand it: vitconvert does, no ./~ folder
    assert first.exit_code == 0, first.output
    assert (tmp_path / "home" / "gaps.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "~").exists()
    assert_one_line_error(invoke(*args, "--plot", "~/gaps.png"), "already exists; use --force")
    assert invoke(*args, "--plot", "~/gaps.png", "--force").exit_code == 0


EXPORT_REFUSALS = [
    (["--out", "{ws}/other/model.safetensors", "--force"], "does not end in .onnx"),  # another model's weights
    (["--out", "{ws}/notes.txt", "--force"], "does not end in .onnx"),
    (["--out", "x.pt2"], "does not end in .onnx"),  # ONNX bytes under the other format's name
    (["--format", "pt2", "--out", "x.onnx"], "does not end in .pt2"),
    (["--out", "{ws}/photo.onnx", "--force"], "not written by vitconvert"),  # a file of that name, not ours
]


@pytest.mark.parametrize("args, text", EXPORT_REFUSALS, ids=[t for _, t in EXPORT_REFUSALS])
def test_export_never_writes_over_another_file(ws, args, text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (ws / "other").mkdir(exist_ok=True)
    (ws / "other" / "model.safetensors").write_bytes(b"another model's weights")
    (ws / "photo.onnx").write_bytes(b"not an onnx file")
    before = digest(ws)
    assert_one_line_error(invoke("export", ws / "student-elu", *[a.format(ws=ws) for a in args]), text)
    assert digest(ws) == before and list(tmp_path.iterdir()) == []


def test_export_replaces_its_own_file_with_force_and_refuses_one_being_written(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["export", ws / "student-elu", "--format", "pt2", "--out", "new.pt2"]
    holder = hold_lock(tmp_path / "new.pt2")
    try:
        busy = invoke(*args)
    finally:
        holder.kill()
        holder.wait()
    assert_one_line_error(busy, f"new.pt2 is being written by another vitconvert command (pid {holder.pid}")
    assert not (tmp_path / "new.pt2").exists()
    retry = invoke(*args)  # the dead holder's lock
    assert retry.exit_code == 0, retry.output
    assert invoke(*args, "--force").exit_code == 0  # its own mark: --force may replace it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.pt2"]  # no lock or temporary left


def test_two_distills_into_one_new_folder_do_not_mix(ws, tmp_path):
    """Two real processes started together into the same new --out: one runs, the other is refused at once."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "vitconvert", "distill", str(ws / "student-elu"), "--data",
                               str(ws / "images"), *QUICK, "--set", "compare_batches=0", "--seed", str(seed),
                               "--out", "run"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    winner = next(i for i, (code, _) in enumerate(results) if code == 0)
    loser_err = results[1 - winner][1]
    assert loser_err.startswith("error: ") and ("being written by another vitconvert command" in loser_err
                                                or "already exists" in loser_err), loser_err
    recipe = (tmp_path / "run" / "recipe.yaml").read_text()
    assert f"seed: {winner + 1}" in recipe
    epochs = [json.loads(line)["epoch"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"val_top1"' in line]
    assert epochs == [1]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".run")]  # no lock left


def test_a_failed_download_leaves_no_data_dir(ws, tmp_path, monkeypatch):
    """--download of a timm dataset that fails (here: offline) removes the --data-dir it created."""
    import urllib.error
    import urllib.request

    def offline(*args, **kwargs):  # what urllib raises with no network, without waiting for a resolver
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.chdir(tmp_path)
    result = invoke("eval", ws / "student-elu", "--data", "torch/cifar10", "--data-dir", "data/cifar", "--download")
    assert_one_line_error(result, "cannot download torch/cifar10 into data/cifar: the network does not answer "
                                  "([Errno -2] Name or service not known)")
    assert "urlopen" not in result.stderr  # urllib's own "<urlopen error ...>" wording
    assert list(tmp_path.iterdir()) == []
