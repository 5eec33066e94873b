"""No dead end (issue 23): a stop is not an error and the run folder alone resumes it; distill never trains a
student it was not given; the machine's failures (a full disk, an architecture that does not fit) are one line
that says so, not an internal error; export takes any batch. (convert --img-size then distill: test_results.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distill.helpers import CLI_FAST, make_student, make_workspace
from helpers import assert_one_line_error, invoke

REPO = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("dead-ends"))


EPOCHS = 12  # the SIGINT lands after the first; the resume trains the rest (in this process)


def test_ctrl_c_is_a_stop_and_the_run_folder_alone_resumes_it(ws, tmp_path):
    """A real SIGINT mid-run: exit 130 (not `error:`), the line says how to continue; that command — the run
    folder and nothing else, no recipe flags retyped — finishes the run."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vitconvert", "distill", str(ws / "student-elu"), "--data",
                             str(ws / "images"), "--epochs", str(EPOCHS), *CLI_FAST, "--out", "run"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and not (
            metrics.is_file() and '"val_top1"' in metrics.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 130 and last.startswith("stopped by SIGINT"), (proc.returncode, err)
    assert "error" not in err and "vitconvert distill --resume --out run" in last, err
    done = json.loads((tmp_path / "run" / "checkpoint-last" / "trainer.json").read_text())["position"]["epoch"]
    assert 1 <= done < EPOCHS

    os.chdir(tmp_path)  # no STUDENT, no --data, no --epochs: the run says them
    try:
        resumed = invoke("distill", "--resume", "--out", "run")
    finally:
        os.chdir(REPO)
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((tmp_path / "run" / "config.json").read_text())["vitconvert"]["metrics"]["epochs"] == EPOCHS


@pytest.mark.parametrize("moment", ["validate", "compare"])
def test_ctrl_c_in_the_last_epochs_end_is_a_stop_too(ws, tmp_path, monkeypatch, moment):
    """Ctrl-C in the last epoch's validation (it was ignored: the run finished, exit 0) or in the end-of-run
    comparison (it was `error: interrupted` with no final model, and --resume called the run complete): a stop as in
    any epoch, and --resume writes the final model of the trained weights."""
    from safetensors.torch import load_file

    from vitconvert.distill import trainer

    target, name = (trainer.Trainer, "validate") if moment == "validate" else (trainer, "compare_at_end")
    real = getattr(target, name)

    def interrupted(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # as a terminal's Ctrl-C: the handler distill installed gets it
        return real(*args, **kwargs)

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(target, name, interrupted)
    fast = ["compare_batches=1" if a == "compare_batches=0" else a for a in CLI_FAST]  # the comparison runs
    stopped = invoke("distill", ws / "student-elu", "--data", ws / "images", "--epochs", "1", *fast, "--out", "run")
    last = stopped.stderr.strip().splitlines()[-1]
    assert stopped.exit_code == 130 and last.startswith("stopped by SIGINT after the last epoch"), stopped.output
    assert "vitconvert distill --resume --out run" in last and "error" not in stopped.stderr
    assert not (tmp_path / "run" / "config.json").exists()  # no final model yet: the run is not complete
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored

    monkeypatch.setattr(target, name, real)
    resumed = invoke("distill", "--resume", "--out", "run")
    assert resumed.exit_code == 0, resumed.output
    final = tmp_path / "run" / "config.json"
    assert json.loads(final.read_text())["vitconvert"]["metrics"]["epochs"] == 1
    trained = load_file(tmp_path / "run" / "checkpoint-last" / "model.safetensors")
    kept = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(kept[k], v) for k, v in trained.items() if k in kept) and kept.keys() <= trained.keys()


def test_distill_after_a_failed_convert_names_the_folder_it_takes(ws, tmp_path, monkeypatch):
    """A failed convert keeps the record of the last one that finished (issue 39: wiping it made distill say no
    convert had finished, which was false); distill with no STUDENT then takes that folder and says so first."""
    monkeypatch.chdir(tmp_path)
    assert invoke("convert", ws / "teacher", "--to", "elu", "--out", "first").exit_code == 0
    failed = invoke("convert", ws / "teacher", "--to", "elu", "--option", "eps=-1", "--out", "second")
    assert failed.exit_code != 0 and not (tmp_path / "second").exists()
    ran = invoke("distill", "--data", ws / "images", "--epochs", "1", *CLI_FAST, "--out", "r")
    assert ran.exit_code == 0, ran.output
    assert "first" in ran.output.splitlines()[0], ran.output


def test_a_full_disk_during_distill_is_one_line(ws, tmp_path, monkeypatch):
    """safetensors reports ENOSPC as its own SafetensorError: still the documented 'cannot write ...' line."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    result = invoke("distill", ws / "student-elu", "--data", ws / "images", "--epochs", "1", *CLI_FAST, "--out", "r")
    last = result.stderr.strip().splitlines()[-1]  # after the run's progress lines
    assert result.exit_code == 1 and last.startswith("error: cannot write r/") and "No space left on device" in last
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr


def test_a_checkpoint_of_another_architecture_is_one_line(ws, tmp_path, monkeypatch):
    """A checkpoint written before runs recorded their student: load_state_dict's reason, not its header."""
    monkeypatch.chdir(tmp_path)
    args = ["--data", ws / "images", "--epochs", "1", *CLI_FAST, "--out", "r"]
    assert invoke("distill", ws / "student-elu", *args).exit_code == 0
    trainer = tmp_path / "r" / "checkpoint-last" / "trainer.json"
    meta = json.loads(trainer.read_text())
    del meta["job"]
    trainer.write_text(json.dumps(meta))
    wide = make_student(tmp_path / "wide", embed_dim=48)
    result = invoke("distill", wide, *args[:-2], "--epochs", "2", "--resume", "--force", "--out", "r")
    assert_one_line_error(result, "does not fit the student")
    assert "size mismatch" in result.stderr and "Error(s) in loading" not in result.stderr


def test_export_takes_any_batch_by_default_even_one(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("export", ws / "student-elu", "--format", "pt2", "--batch-size", "1", "--out", "m.pt2", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["dynamic_batch"] and report["checked_batches"] == [1, 2] and len(result.stderr.splitlines()) < 3
