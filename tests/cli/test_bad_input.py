"""The bad-input sweep: every command with the inputs users get wrong, as one table (issues 10.4 and 17).

Each case must end with exactly one line starting ``error:``, a non-zero exit, no traceback, nothing written
(the case's working directory stays empty) and every input byte-identical (the whole workspace is hashed
before and after, file modes included). docs/bad-input.md is generated from CASES (tests/cli/bad_input_cases.py):
``VITCONVERT_WRITE_DOCS=1 python -m pytest tests/cli/test_bad_input.py -k docs`` rewrites it, and
``test_docs_table_lists_every_case`` fails when the two differ.

Read-only output folders: the tests run as root, where chmod stops nothing, so the read-only case writes into
/sys (read-only for root too: creating the output's lock file there fails with EACCES), a real path rather than
a simulation; the full-disk case raises ENOSPC at the writer's boundary (tempfile.mkdtemp in vitconvert/writer.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from bad_input_cases import CASES, PREPARE, QUICK, Case, truncate
from distill.helpers import make_images, make_student, make_teacher
from helpers import runner, wait_until_torch_loads

from vitconvert.cli import app
from vitconvert.cli.common import HEARTBEAT_LINE
from vitconvert.recipes import FIELDS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "bad-input.md"


def error_lines(stderr: str) -> list[str]:
    """stderr's lines without still_working's heartbeat, which a loaded machine prints before a late refusal: the
    error itself must still be one line."""
    return [line for line in stderr.strip().splitlines() if not HEARTBEAT_LINE.match(line)]


# -- the workspace every case reads ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-input")
    student = make_student(root)
    images = make_images(root / "images")
    paths = {"ws": root, "teacher": root / "teacher", "student": student, "images": images,
             "two": make_images(root / "two", classes=2), "five": make_images(root / "five", classes=5),
             "one": make_images(root / "one", classes=1)}
    emptyval = make_images(root / "emptyval")
    for cls in (emptyval / "val").iterdir():
        for f in cls.iterdir():
            f.unlink()
    paths["emptyval"] = emptyval
    emptyclass = make_images(root / "emptyclass")
    (emptyclass / "val" / "class3").mkdir()
    renamedval = make_images(root / "renamedval")
    (renamedval / "val" / "class1").rename(renamedval / "val" / "renamed")
    paths.update(emptyclass=emptyclass, renamedval=renamedval,
                 headless=make_teacher(root / "headless", num_classes=0))
    (root / "afile.txt").write_text("not a model\n")
    paths["afile"] = root / "afile.txt"
    (root / "garbage.pth").write_text("not a torch file\n")  # a download that saved an error page, say
    paths["garbagepth"] = root / "garbage.pth"
    from timm.models import save_for_hf

    from vitconvert import load

    save_for_hf(load(student), str(root / "timmsaved"), safe_serialization=True)  # no vitconvert block
    paths["timmsaved"] = root / "timmsaved"
    (root / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n the user's own picture")
    (root / "user.onnx").write_bytes(b"the user's own model")
    paths["photo"], paths["useronnx"] = root / "photo.png", root / "user.onnx"
    precious = root / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "precious.txt").write_text("the user's own work\n")
    (precious / "sub" / "notes.md").write_text("keep\n")
    paths["precious"] = precious
    for name, edit in (("trunc", None), ("badvar", "variant"), ("noarch", "architecture"), ("badopt", "options"),
                       ("badlayers", [0, 5]), ("nolinear", []), ("relabelled", "relu"), ("stringlayers", "1-3")):
        folder = shutil.copytree(student, root / name)
        if edit is None:
            truncate(folder / "model.safetensors")
            continue
        config = json.loads((folder / "config.json").read_text())
        if edit == "variant":
            config["vitconvert"]["variant"] = "foo"
        elif edit == "options":
            config["vitconvert"]["options"] = {"eps": "abc"}
        elif isinstance(edit, list):
            config["vitconvert"]["layers"] = config["model_args"]["layers"] = edit
        elif edit == "relu":
            config["architecture"], config["vitconvert"]["variant"] = "vitconvert_relu", "relu"
        elif edit == "1-3":
            config["model_args"]["layers"] = edit
        else:
            del config["architecture"]
        (folder / "config.json").write_text(json.dumps(config))
        paths[name] = folder
    paths["trunc"] = root / "trunc"
    disguised = shutil.copytree(root / "teacher", root / "disguised")  # softmax config.json, a student's weights
    shutil.copy(student / "model.safetensors", disguised / "model.safetensors")
    paths["disguised"] = disguised
    converted = runner.invoke(app, ["convert", str(root / "teacher"), "--to", "inline", "--out", str(root / "inline")])
    assert converted.exit_code == 0, converted.output
    paths["inline"] = root / "inline"  # a student whose weights are no normalised kernel (attn_loss=weight_ce)
    result = runner.invoke(app, ["distill", str(student), "--data", str(images), *QUICK, "--set", "compare_batches=0",
                                 "--out", str(root / "run")])
    assert result.exit_code == 0, result.output
    paths["run"] = root / "run"
    stopped = shutil.copytree(root / "run", root / "stopped")  # as a stop before the end leaves a run
    for name in ("config.json", "model.safetensors", "README.md", "best"):
        shutil.rmtree(stopped / name) if (stopped / name).is_dir() else (stopped / name).unlink()
    paths["stopped"] = stopped
    return paths


def tree_hash(root: Path) -> str:
    """Names, bytes and modes of everything under ``root``: the inputs are unchanged iff this is."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        h.update(f"{path.relative_to(root)}:{st.st_mode:o}".encode())
        if path.is_file() and not path.is_symlink():
            h.update(path.read_bytes())
    return h.hexdigest()


def empty_hub_cache(monkeypatch, cwd: Path) -> None:
    """HF_HUB_OFFLINE set and a Hub cache that holds nothing (as on a fresh machine), whatever this one caches."""
    import huggingface_hub.constants as c

    cache = cwd.parent / "hub-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))


def hub_unreachable(monkeypatch, cwd: Path) -> None:
    """Online (HF_HUB_OFFLINE unset) with a Hub that refuses the connection: a closed local port, so no request
    leaves the machine even where there is a network."""
    import huggingface_hub.constants as c

    empty_hub_cache(monkeypatch, cwd)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(c, "ENDPOINT", "http://127.0.0.1:9")


def no_network(monkeypatch, cwd: Path) -> None:
    """Every plain-urllib download (torchvision's datasets) fails as a machine without DNS answers."""
    import socket
    import urllib.request
    from urllib.error import URLError

    def fail(*args, **kwargs):
        raise URLError(socket.gaierror(-2, "Name or service not known"))

    monkeypatch.setattr(urllib.request, "urlopen", fail)


NETWORK = {"empty_hub_cache": empty_hub_cache, "hub_unreachable": hub_unreachable, "no_network": no_network}


def run_case(case: Case, workspace: dict[str, Path], cwd: Path, monkeypatch):
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    if case.prepare in NETWORK:
        NETWORK[case.prepare](monkeypatch, cwd)
    elif case.prepare == "disk_full":
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr("vitconvert.writer.tempfile.mkdtemp", full)
    elif case.prepare == "no_datasets":  # whether or not it is installed here: as if it were not
        monkeypatch.setitem(sys.modules, "datasets", None)
    elif case.prepare in ("world_size_2", "world_size_abc"):
        monkeypatch.setenv("WORLD_SIZE", case.prepare.rsplit("_", 1)[1])
    elif case.prepare and case.prepare.startswith("env:"):  # env:NAME=VALUE
        monkeypatch.setenv(*case.prepare.removeprefix("env:").split("=", 1))
    elif case.prepare:
        PREPARE[case.prepare](cwd, workspace["ws"])
    args = [a.format(**{k: str(v) for k, v in workspace.items()}) for a in case.args]
    extra = cwd.parent / "rc"
    before = tree_hash(workspace["ws"]), tree_hash(extra) if extra.exists() else None
    start = time.perf_counter()
    result = runner.invoke(app, args)
    seconds = time.perf_counter() - start
    after = tree_hash(workspace["ws"]), tree_hash(extra) if extra.exists() else None
    return result, seconds, before, after


def normalized(line: str, workspace: dict[str, Path], tmp: Path) -> str:
    """The printed line with this machine's temporary paths as the placeholders the docs show."""
    for name, path in sorted(workspace.items(), key=lambda kv: -len(str(kv[1]))):
        line = line.replace(str(path), "{" + name + "}")
    return line.replace(str(tmp), "{tmp}")


RECORDED: dict[str, str] = {}  # case key -> normalized line, for VITCONVERT_WRITE_DOCS=1


def key(case: Case) -> str:
    return f"{case.command}: {case.given}"


@pytest.mark.parametrize("case", CASES, ids=[key(c) for c in CASES])
def test_bad_input(case, workspace, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    result, _, before, after = run_case(case, workspace, cwd, monkeypatch)
    assert result.exit_code != 0, result.output
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert case.message in lines[0], lines[0]
    assert "Traceback" not in result.output + result.stderr
    assert before == after, "an input changed"
    assert list(cwd.iterdir()) == [], "something was written"
    assert not any(Path(f"/sys/vc-{name}").exists() for name in ("out", "run", "plot.png"))
    line = normalized(lines[0], workspace, tmp_path)
    if os.environ.get("VITCONVERT_WRITE_DOCS"):
        RECORDED[key(case)] = line
        if len(RECORDED) == len(CASES):
            write_docs()
        return
    assert documented().get(key(case)) == line, "docs/bad-input.md shows another message: regenerate it"


# -- --set: every recipe field, an invalid value, refused in seconds before any folder exists -------------
WRONG_TYPE = {bool: "maybe", int: "x", float: "x", str: "[1, 2]"}
RANGE = {"epochs": 0, "batch_size": -4, "accum_steps": 0, "lr": -1, "min_lr": "nan", "warmup_lr": -1,
         "weight_decay": -0.1, "momentum": 2, "hflip": 1.5, "reprob": -0.5, "mixup_prob": 3, "mixup_switch_prob": 2,
         "smoothing": 1, "scale": "[0.9, 0.1]", "crop_pct": 1.5, "mean": "[0.5, 0.5]", "std": "[0, 1, 1]",
         "clip_grad": -1, "ema_decay": 1.5, "workers": -2, "img_size": 0, "drop_path": 1.5, "kd_temperature": 0,
         "recount": 0, "log_interval": 0, "compare_batches": -1, "layer_decay": 2, "freeze_copied_epochs": -1,
         "warmup_epochs": -1, "seed": -1, "attn_weight": -1, "kd_weight": "inf", "color_jitter": -1, "mixup": -1,
         "cutmix": -1, "opt": "nosuchopt", "sched": "nosuch", "clip_mode": "foo", "remode": "nosuch",
         "interpolation": "nosuch", "rand_augment": "rand-m9-zzz1", "attn_loss": "l3", "attn_target": "nobody",
         "amp_dtype": "int8", "mixup_mode": "nosuch", "stages": "nosuch", "new_params": "{lr_scale: 0}",
         "val_split": "[1]", "train_split": "[1]", "data": "[1]", "data_dir": "[1]", "name": "[1]",
         "no_aug": "maybe", "download": "maybe", "sched_on_updates": "maybe", "ema": "maybe", "amp": "maybe",
         "scale_schedule": "maybe", "schedule_scaled": "[1]"}


def test_every_recipe_field_has_an_invalid_value():
    assert set(RANGE) == set(FIELDS)


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_set_invalid_value_fails_fast_before_any_folder(field, workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    data = [] if field == "data" else ["--data", str(workspace["images"])]  # --data would win over --set data=
    result = runner.invoke(app, ["distill", str(workspace["student"]), *data, "--set", f"{field}={RANGE[field]}",
                                 "--out", "r"])
    seconds = time.perf_counter() - start
    lines = result.stderr.strip().splitlines()
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert field.split(".")[0] in lines[0] or "stage" in lines[0], lines[0]
    assert seconds < 5, f"{seconds:.1f}s"
    assert list(tmp_path.iterdir()) == []


# -- the two data-loss cases of issue 17, byte for byte -----------------------------------------------------
def test_force_never_destroys_what_vitconvert_did_not_write(workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(workspace["ws"])
    before = tree_hash(workspace["ws"])
    same = runner.invoke(app, ["convert", "./teacher", "--to", "elu", "--out", "teacher", "--force"])
    other = runner.invoke(app, ["convert", "./teacher", "--to", "elu", "--out", "precious", "--force"])
    assert tree_hash(workspace["ws"]) == before
    for result, text in ((same, "is the input"), (other, "not written by vitconvert")):
        lines = result.stderr.strip().splitlines()
        assert result.exit_code != 0 and len(lines) == 1 and text in lines[0], result.stderr


def test_force_replaces_a_vitconvert_folder(workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(workspace["student"], tmp_path / "old")
    result = runner.invoke(app, ["convert", str(workspace["teacher"]), "--to", "relu", "--out", "old", "--force"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "old" / "config.json").read_text())["vitconvert"]["variant"] == "relu"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".vitconvert", "old"]  # no temporary or old sibling


def test_a_failed_start_leaves_no_run_folder_and_the_rerun_works(workspace, tmp_path, monkeypatch):
    """A run that dies before its first checkpoint leaves nothing; one that replaced a run (--force) brings the
    old run back unchanged; the same command then simply runs."""
    from vitconvert.distill.trainer import Trainer
    from vitconvert.errors import VitconvertError

    def dies(self, epoch):
        raise VitconvertError("the loss became NaN or infinite at epoch 1 (simulated)")

    monkeypatch.chdir(tmp_path)
    shutil.copytree(workspace["run"], tmp_path / "old")
    old = tree_hash(tmp_path / "old")
    args = ["distill", str(workspace["student"]), "--data", str(workspace["images"]), *QUICK,
            "--set", "compare_batches=0"]
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "end_epoch", dies)
        failed = runner.invoke(app, [*args, "--out", "r"])
        replaced = runner.invoke(app, [*args, "--out", "old", "--force"])
    for result in (failed, replaced):
        assert result.exit_code != 0 and "simulated" in result.stderr, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"] and tree_hash(tmp_path / "old") == old
    rerun = runner.invoke(app, [*args, "--out", "r"])
    assert rerun.exit_code == 0, rerun.output
    assert (tmp_path / "r" / "checkpoint-last").is_dir()


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    """SIGINT while torch and timm import (before any command code runs) prints one line, no traceback."""
    import signal
    import subprocess

    script = shutil.which("vitconvert")
    if script is None:
        pytest.skip("the vitconvert console script is not installed")
    proc = subprocess.Popen([script, "convert", "deit_tiny", "--to", "elu", "--no-pretrained", "--out", "o"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                            # as at a terminal: SIGINT at its default disposition, whatever this test process
                            # inherited (an ignored SIGINT survives exec, and the command then just completes)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_until_torch_loads(proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert err == "error: interrupted\n" and proc.returncode in (-signal.SIGINT, 130, 1), (proc.returncode, err)
    assert list(tmp_path.iterdir()) == []


def test_push_refreshes_the_card_with_the_umask(workspace, tmp_path, monkeypatch, online):
    """push rewrites README.md as a plain file (not 0600); its --dry-run writes nothing (tests/test_hub.py)."""
    from helpers import FAKE_TOKEN, FakeHub

    monkeypatch.chdir(tmp_path)
    shutil.copytree(workspace["run"], tmp_path / "run")
    FakeHub(monkeypatch)
    old = os.umask(0o022)
    try:
        result = runner.invoke(app, ["push", "run", "--repo", "me/x", "--token", FAKE_TOKEN])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "README.md").stat().st_mode & 0o777 == 0o644


def test_bundled_name_wins_over_a_local_folder_of_the_same_name(tmp_path, monkeypatch):
    """`convert digits` means the bundled teacher even where ./digits is an image folder (as --data digits does);
    ./digits still names the folder."""
    monkeypatch.chdir(tmp_path)
    make_images(tmp_path / "digits")
    result = runner.invoke(app, ["convert", "digits", "--to", "elu", "--out", "s"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "s" / "config.json").read_text())["vitconvert"]["source"] == "digits"
    local = runner.invoke(app, ["convert", "./digits", "--to", "elu", "--out", "t"])
    assert local.exit_code != 0 and "no config.json" in local.stderr


# -- the docs table ------------------------------------------------------------------------------------
HEADER = "| # | command | what the user got wrong | what vitconvert prints (exit 1, or 2 for parser errors) |"


def cell(text: str) -> str:
    return "`` " + text.replace("|", "\\|") + " ``"


def write_docs() -> None:
    text = DOCS.read_text()
    head = text.partition(HEADER)[0]
    head = re.sub(r"\*\*\d+ cases\*\*", f"**{len(CASES)} cases**", head)
    rows = [HEADER, "|---|---|---|---|"]
    for i, case in enumerate(CASES, 1):
        rows.append(f"| {i} | `{case.command}` | {case.given.replace('|', '/')} | {cell(RECORDED[key(case)])} |")
    DOCS.write_text(head + "\n".join(rows) + "\n")


def documented() -> dict[str, str]:
    """case key -> the message docs/bad-input.md shows for it."""
    rows = {}
    for line in DOCS.read_text().partition(HEADER)[2].splitlines()[2:]:
        _, command, given, message = line[2:-2].split(" | ", 3)
        rows[f"{command.strip('`')}: {given}"] = message[3:-3].replace("\\|", "|")
    return rows


def test_docs_table_lists_every_case():
    """The table's rows are the cases, in order, and its stated count is theirs."""
    text = DOCS.read_text()
    assert HEADER in text and f"**{len(CASES)} cases**" in text
    assert list(documented()) == [key(c) for c in CASES]
