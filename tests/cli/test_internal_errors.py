"""Values the first checks let through that failed later as "internal error" lines: each is now one line that
says what is wrong, through the command as a user runs it (typer's runner), with nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
from distill.helpers import FAST, make_images, make_student
from helpers import assert_one_line_error, invoke

from vitconvert.attention import variant_class  # noqa: F401  (registers the variants before the runner)
from vitconvert.distill.sums import TERMS

QUICK = ["--epochs", "1", "--batch-size", "4", "--set", "compare_batches=0"] + [
    a for k, v in FAST.items() if k not in ("epochs", "batch_size") for a in ("--set", f"{k}={json.dumps(v)}")]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("internal")
    paths = {"elu": make_student(root), "images": make_images(root / "images"), "root": root}
    paths["mhla"] = make_student(root / "m", "mhla")
    for name in ("elu", "mhla"):
        done = invoke("distill", paths[name], "--data", paths["images"], *QUICK, "--out", root / f"run-{name}")
        assert done.exit_code == 0, done.output
    return paths


@pytest.mark.parametrize(("pair", "message"), [
    ("opt=adahessian", "recipe opt: 'adahessian' is a second-order optimizer: it needs a backward that keeps its "
                       "graph (create_graph), which distill does not run; choose a first-order one, e.g. adamw"),
    ("opt=lookahead_adahessian", "is a second-order optimizer"),
    ("sched=plateau", "recipe sched: 'plateau' steps on a validation metric once per epoch"),
])
def test_recipe_values_that_fail_later_are_refused_first(ws, tmp_path, monkeypatch, pair, message):
    monkeypatch.chdir(tmp_path)
    result = invoke("distill", ws["elu"], "--data", ws["images"], "--set", pair, "--out", "r")
    assert_one_line_error(result, message)
    assert list(tmp_path.iterdir()) == []


def test_a_cuda_only_optimizer_on_a_cpu_is_refused_first(ws, tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("bitsandbytes' optimizers run where CUDA is")
    monkeypatch.chdir(tmp_path)
    result = invoke("distill", ws["elu"], "--data", ws["images"], "--set", "opt=bnbadam", "--out", "r")
    assert_one_line_error(result, "recipe opt: 'bnbadam' cannot run on this machine (CUDA required for bitsandbytes "
                                  "optimizers); choose another, e.g. adamw")
    assert list(tmp_path.iterdir()) == []


def test_a_binary_recipe_file(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    result = invoke("distill", ws["elu"], "--data", ws["images"], "--recipe", "r.yaml", "--out", "r")
    assert_one_line_error(result, "r.yaml is not a recipe: a recipe is YAML text, and this file is binary (not UTF-8 "
                                  "at byte 0)")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary", b"a\x00b\n"])
def test_a_binary_last_convert_record(ws, tmp_path, monkeypatch, content):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".vitconvert").mkdir()
    (tmp_path / ".vitconvert" / "last_convert").write_bytes(content)
    assert_one_line_error(invoke("distill", "--data", ws["images"]),
                          ".vitconvert/last_convert holds no folder path (damaged; the next convert here rewrites "
                          "it): name the STUDENT folder")


@pytest.mark.parametrize("endpoint", ["hub.local", "htp//bad url", "https://host:abc", "::::"])
def test_a_malformed_hf_endpoint(tmp_path, monkeypatch, endpoint):
    """Every command, before huggingface_hub is imported (a port that is no number breaks that import)."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "HF_ENDPOINT": endpoint}
    done = subprocess.run([sys.executable, "-m", "vitconvert", "info", "hf-hub:org/name"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: HF_ENDPOINT={endpoint!r} is not a Hub address: expected http(s)://HOST[:PORT] (unset it for "
        "https://huggingface.co)"]


def test_far_too_many_threads(ws, tmp_path, monkeypatch):
    from vitconvert.threads import PER_CORE, cores

    monkeypatch.chdir(tmp_path)
    result = invoke("convert", ws["root"] / "teacher", "--to", "elu", "--threads", "100000", "--out", "m")
    assert_one_line_error(result, f"--threads: 100000 is more than {PER_CORE} per core of this machine's {cores()} "
                                  f"(at most {PER_CORE * cores()})")
    assert not (tmp_path / "m").exists()
    assert invoke("convert", ws["root"] / "teacher", "--to", "elu", "--threads", str(cores() + 1),
                  "--out", "m").exit_code == 0  # a little oversubscription is the user's choice


def damaged_run(ws, tmp_path, damage) -> str:
    run = shutil.copytree(ws["root"] / "run-elu", tmp_path / "rc")
    damage(run / "checkpoint-last")
    return str(run)


def edit_position(checkpoint, **changes):
    meta = json.loads((checkpoint / "trainer.json").read_text())
    meta["position"].update(changes)
    (checkpoint / "trainer.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("field", ["epoch_sums", "window_sums"])
@pytest.mark.parametrize("length", [2, 9])
def test_running_sums_of_the_wrong_length(ws, tmp_path, monkeypatch, field, length):
    monkeypatch.chdir(tmp_path)
    run = damaged_run(ws, tmp_path, lambda c: edit_position(c, **{field: [0.0] * length}))
    result = invoke("distill", "--resume", "--force", "--epochs", "2", "--out", run)
    assert_one_line_error(result, f"trainer.json lacks or mangles 'position.{field}' ({len(TERMS) + 1} numbers: "
                                  f"{', '.join(TERMS)} and the image count): the checkpoint is damaged")


def test_a_missing_trainer_json_without_a_student_named(ws, tmp_path, monkeypatch):
    """The run cannot say its student then: the checkpoint's own error, not "no STUDENT given"."""
    monkeypatch.chdir(tmp_path)
    run = damaged_run(ws, tmp_path, lambda c: (c / "trainer.json").unlink())
    assert_one_line_error(invoke("distill", "--resume", "--out", run),
                          "checkpoint-last has no trainer.json: the checkpoint is damaged")


def test_optimizer_state_of_another_model(ws, tmp_path, monkeypatch):
    """An MHLA run's optimizer files in an ELU run: refused, not loaded where names meet."""
    monkeypatch.chdir(tmp_path)

    def foreign(checkpoint):
        other = ws["root"] / "run-mhla" / "checkpoint-last"
        shutil.copy(other / "optimizer.safetensors", checkpoint / "optimizer.safetensors")
        meta = json.loads((checkpoint / "trainer.json").read_text())
        meta["optimizer"] = json.loads((other / "trainer.json").read_text())["optimizer"]
        (checkpoint / "trainer.json").write_text(json.dumps(meta))

    run = damaged_run(ws, tmp_path, foreign)
    result = invoke("distill", "--resume", "--force", "--epochs", "2", "--out", run)
    assert result.exit_code == 1 and "Traceback" not in result.output  # after the run's own status lines:
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the checkpoint's optimizer state is not of this student's parameters (it has "
        "'student.blocks.0.attn.block_mix'): optimizer.safetensors belongs to another model; start over with --force "
        "without --resume")
