"""The bad-input sweep: every command with the inputs users get wrong, as one table (issues 10.4 and 17).

Each case must end with exactly one line starting ``error:``, a non-zero exit, no traceback, nothing written
(the case's working directory stays empty) and every input byte-identical (the whole workspace is hashed
before and after, file modes included). docs/bad-input.md is generated from CASES:
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from distill.helpers import FAST, make_images, make_student, make_teacher
from helpers import runner

from vitconvert.cli import app
from vitconvert.recipes import FIELDS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "bad-input.md"
# lr as a flag: the cases below give --lr again (a later flag wins), and a key given by --set and its flag is refused
QUICK = ["--epochs", "1", "--batch-size", "4", "--lr", str(FAST["lr"])] + [
    a for k, v in FAST.items() if k not in ("epochs", "batch_size", "lr") for a in ("--set", f"{k}={json.dumps(v)}")]


@dataclass(frozen=True)
class Case:
    command: str
    given: str  # what the user got wrong, for the docs table
    args: tuple[str, ...]  # {placeholders} name paths of the workspace (see `workspace`) or of the case's cwd
    message: str  # a fragment of the one error line
    prepare: Optional[str] = None  # a function of PREPARE run in the case's cwd first, or env:NAME=VALUE


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def run_copy(cwd: Path, ws: Path, damage: Callable[[Path], None]) -> None:
    shutil.copytree(ws / "run", cwd.parent / "rc")
    damage(cwd.parent / "rc")


PREPARE: dict[str, Callable[[Path, Path], None]] = {
    "trunc_model": lambda cwd, ws: run_copy(cwd, ws, lambda r: truncate(r / "checkpoint-last" / "model.safetensors")),
    "trunc_optimizer": lambda cwd, ws: run_copy(
        cwd, ws, lambda r: truncate(r / "checkpoint-last" / "optimizer.safetensors")),
    "trunc_rng": lambda cwd, ws: run_copy(cwd, ws, lambda r: truncate(r / "checkpoint-last" / "rng.safetensors")),
    "no_optimizer": lambda cwd, ws: run_copy(
        cwd, ws, lambda r: (r / "checkpoint-last" / "optimizer.safetensors").unlink()),
    "bad_trainer_json": lambda cwd, ws: run_copy(
        cwd, ws, lambda r: (r / "checkpoint-last" / "trainer.json").write_text('{"format": 1}')),
    "half_run": lambda cwd, ws: run_copy(cwd, ws, lambda r: (r / "checkpoint-last" / "trainer.json").unlink()),
    "negative_position": lambda cwd, ws: run_copy(cwd, ws, lambda r: edit_json(
        r / "checkpoint-last" / "trainer.json", lambda meta: meta["position"].update(epoch=-1))),
}


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))

S = ("{student}",)
D = ("--data", "{images}")
CASES: list[Case] = [
    # -- convert --------------------------------------------------------------------------------------
    Case("convert", "missing source path", ("convert", "./nope/", "--to", "elu", "--out", "o"), "not found"),
    Case("convert", "a text file as source", ("convert", "{afile}", "--to", "elu", "--out", "o"),
         "is a file, not a model"),
    Case("convert", "unknown variant", ("convert", "{teacher}", "--to", "nosuch", "--out", "o"), "unknown variant"),
    Case("convert", "a converted model as source", ("convert", "{student}", "--to", "elu", "--out", "o"),
         "already a linear-attention"),
    Case("convert", "a run folder as source", ("convert", "{run}", "--to", "elu", "--out", "o"),
         "already a linear-attention"),
    Case("convert", "--out is the source (--force)", ("convert", "{teacher}", "--to", "elu", "--out", "{teacher}",
                                                      "--force"), "is the input"),
    Case("convert", "--out inside the source", ("convert", "{teacher}", "--to", "elu", "--out", "{teacher}/sub"),
         "is inside the input"),
    Case("convert", "--out holds the source (--force)", ("convert", "{teacher}", "--to", "elu", "--out", "{ws}",
                                                         "--force"), "contains the input"),
    Case("convert", "--out an unrelated folder (--force)", ("convert", "{teacher}", "--to", "elu", "--out",
                                                            "{precious}", "--force"), "not written by vitconvert"),
    Case("convert", "VITCONVERT_FUSED=maybe", ("convert", "{teacher}", "--to", "elu", "--out", "o"),
         "VITCONVERT_FUSED='maybe': expected 0", "env:VITCONVERT_FUSED=maybe"),
    Case("convert", "--out an existing model, no --force", ("convert", "{teacher}", "--to", "elu", "--out",
                                                            "{student}"), "already exists; use --force"),
    Case("convert", "--out below a file", ("convert", "{teacher}", "--to", "elu", "--out", "{afile}/sub"),
         "is a file, not a folder"),
    Case("convert", "--out . (--force)", ("convert", "{teacher}", "--to", "elu", "--out", ".", "--force"),
         "current directory"),
    Case("convert", "--out '' (--force)", ("convert", "{teacher}", "--to", "elu", "--out", "", "--force"),
         "current directory"),
    Case("convert", "--out in a read-only folder", ("convert", "{teacher}", "--to", "elu", "--out", "/sys/vc-out"),
         "cannot write /sys/vc-out"),
    Case("convert", "--out on a full disk", ("convert", "{teacher}", "--to", "elu", "--out", "o"),
         "cannot write o: No space left on device", "disk_full"),
    Case("convert", "--option of the wrong type", ("convert", "{teacher}", "--to", "elu", "--option", "eps=abc",
                                                   "--out", "o"), "elu's eps takes a finite number"),
    Case("convert", "--option out of range", ("convert", "{teacher}", "--to", "elu", "--option", "eps=-1", "--out",
                                               "o"), "eps must be positive"),
    Case("convert", "--option the variant does not have", ("convert", "{teacher}", "--to", "elu", "--option",
                                                           "local_residual=true", "--out", "o"),
         "unknown option 'local_residual' for elu"),
    Case("convert", "--option block_side=0 (mhla)", ("convert", "{teacher}", "--to", "mhla", "--option", "block_side=0",
                                                    "--out", "o"), "block_side must be at least 1 token, got 0"),
    Case("convert", "--option block_side=-3 (mhla: was one block, silently)",
         ("convert", "{teacher}", "--to", "mhla", "--option", "block_side=-3", "--out", "o"),
         "block_side must be at least 1 token, got -3"),
    Case("convert", "--option lepe_kernel=-1 (mhla)", ("convert", "{teacher}", "--to", "mhla", "--option",
                                                       "lepe_kernel=-1", "--out", "o"),
         "lepe_kernel must be odd (or 0 for no LePE), got -1"),
    Case("convert", "--option exp_sigma=0 (mhla: a NaN block mixing)",
         ("convert", "{teacher}", "--to", "mhla", "--option", "transform=exp", "--option", "exp_sigma=0", "--out", "o"),
         "exp_sigma must be positive, got 0"),
    Case("convert", "--option local_threshold=-1 (mhla: a NaN block mixing)",
         ("convert", "{teacher}", "--to", "mhla", "--option", "transform=local", "--option", "local_threshold=-1",
          "--out", "o"), "local_threshold must not be negative, got -1"),
    Case("convert", "--num-classes 0", ("convert", "{teacher}", "--to", "elu", "--out", "o", "--num-classes", "0"),
         "--num-classes: must be at least 1"),
    Case("convert", "--img-size 0", ("convert", "{teacher}", "--to", "elu", "--out", "o", "--img-size", "0"),
         "--img-size: must be at least 1"),
    Case("convert", "non-numeric --seed", ("convert", "{teacher}", "--to", "elu", "--seed", "abc"),
         "Invalid value for '--seed'"),
    Case("convert", "unknown flag", ("convert", "{teacher}", "--to", "elu", "--nosuch"), "No such option: --nosuch"),
    Case("convert", "no source", ("convert",), "Missing argument"),
    Case("convert", "--data without --keep-softmax auto:K", ("convert", "{teacher}", "--to", "elu", "--data", "nope",
                                                             "--out", "o"), "--data: is read only by --keep-softmax"),
    # -- info -------------------------------------------------------------------------------------------
    Case("info", "missing folder", ("info", "nope"), "folder not found"),
    Case("info", "a file", ("info", "{afile}"), "is a file, not a model folder"),
    Case("info", "a softmax (timm) folder", ("info", "{teacher}"), "not a vitconvert model folder"),
    Case("info", "truncated weights", ("info", "{trunc}"), "corrupt or truncated"),
    Case("info", "unknown variant in config.json", ("info", "{badvar}"), "unknown variant 'foo'"),
    Case("info", "config.json without architecture", ("info", "{noarch}"), "names no architecture"),
    Case("info", "an option of the wrong type in config.json", ("info", "{badopt}"), "eps takes a finite number"),
    Case("info", "a stopped run (only checkpoint-last/)", ("info", "{stopped}"), "a distill run that has not finished"),
    Case("eval", "a stopped run (only checkpoint-last/)", ("eval", "{stopped}", *D), "a distill run that has not"),
    Case("export", "a stopped run (only checkpoint-last/)", ("export", "{stopped}", "--out", "x.onnx"),
         "a distill run that has not finished"),
    Case("info", "a layer list past the model's depth", ("info", "{badlayers}"), "must list layer indices"),
    Case("info", "an empty layer list (no linear layer)", ("info", "{nolinear}"), "makes no layer linear"),
    Case("info", "config.json edited from elu to relu (the weights hold ELU)", ("info", "{relabelled}"),
         "holds elu attention weights"),
    Case("eval", "config.json edited from elu to relu (the weights hold ELU)", ("eval", "{relabelled}", *D),
         "holds elu attention weights"),
    Case("eval", "model_args' layer list edited to '1-3'", ("eval", "{stringlayers}", *D),
         "its layers must be a list of layer indices (got '1-3')"),
    Case("convert", "a student's model.safetensors as source (--arch)",
         ("convert", "{student}/model.safetensors", "--arch", "vit_tiny_patch16_224", "--to", "relu", "--out", "o"),
         "holds vitconvert's elu linear attention"),
    Case("convert", "a student's weights under a softmax config.json", ("convert", "{disguised}", "--to", "relu",
                                                                       "--out", "o"),
         "holds vitconvert's elu linear attention"),
    Case("compare", "a student's weights under a softmax config.json as --teacher",
         ("compare", *S, *D, "--teacher", "{disguised}"), "holds vitconvert's elu linear attention"),
    # -- eval -------------------------------------------------------------------------------------------
    Case("eval", "missing model", ("eval", "nope/", *D), "not found"),
    Case("eval", "a text file as model", ("eval", "{afile}", *D), "is a file, not a model"),
    Case("eval", "a bare weights file", ("eval", "{student}/model.safetensors", *D), "bare weights file"),
    Case("eval", "missing data folder", ("eval", *S, "--data", "nope"), "not found"),
    Case("eval", "an option of the wrong type in config.json", ("eval", "{badopt}", *D), "eps takes a finite number"),
    Case("eval", "--data hfds/... without the datasets package", ("eval", *S, "--data", "hfds/foo/bar"),
         "needs the Python package 'datasets'", "no_datasets"),
    Case("eval", "an unknown --split of an image folder", ("eval", *S, *D, "--split", "nosuch"),
         "has no nosuch/ folder for the nosuch split (it has: train, val)"),
    Case("eval", "--split test of a folder with only train/ and val/", ("eval", *S, *D, "--split", "test"),
         "has no test/ folder"),
    Case("eval", "an unknown --split of digits", ("eval", *S, "--data", "digits", "--split", "nosuch"),
         "digits has no 'nosuch' split"),
    Case("eval", "--batch-size 0", ("eval", *S, *D, "--batch-size", "0"), "--batch-size: must be at least 1"),
    Case("eval", "--workers -1", ("eval", *S, *D, "--workers", "-1"), "--workers: must not be negative"),
    Case("eval", "data with more classes than the head", ("eval", *S, "--data", "{five}"), "classes"),
    Case("eval", "an empty class folder", ("eval", *S, "--data", "{emptyclass}"), "class folders without images"),
    Case("eval", "a model without a classification head", ("eval", "{headless}", *D), "no classification head"),
    Case("eval", "--device mps on a machine without it", ("eval", *S, *D, "--device", "mps"),
         "mps is not available on this machine"),
    Case("eval", "non-numeric --batch-size", ("eval", *S, *D, "--batch-size", "x"), "Invalid value for '--batch-size'"),
    # -- distill ----------------------------------------------------------------------------------------
    Case("distill", "a text file as student", ("distill", "{afile}", *D, *QUICK, "--out", "r"),
         "is a file, not a model folder"),
    Case("distill", "missing student", ("distill", "nope", *D, *QUICK, "--out", "r"), "student folder not found"),
    Case("distill", "a softmax folder as student", ("distill", "{teacher}", *D, *QUICK, "--out", "r"),
         "not a vitconvert model folder"),
    Case("distill", "missing data folder", ("distill", *S, "--data", "nope", *QUICK, "--out", "r"),
         "data folder not found"),
    Case("distill", "data with other classes than the head", ("distill", *S, "--data", "{two}", *QUICK, "--out", "r"),
         "the data has 2 classes but the student's head has 3"),
    Case("distill", "an image folder with one class", ("distill", *S, "--data", "{one}", *QUICK, "--out", "r"),
         "class"),
    Case("distill", "an empty split", ("distill", *S, "--data", "{emptyval}", *QUICK, "--out", "r"), "no images"),
    Case("distill", "val/ with a class folder train/ lacks", ("distill", *S, "--data", "{renamedval}", *QUICK,
                                                              "--out", "r"), "not among the train split's classes"),
    Case("distill", "--epochs 0", ("distill", *S, *D, *QUICK, "--epochs", "0", "--out", "r"),
         "epochs must be at least 1"),
    Case("distill", "--epochs -1", ("distill", *S, *D, *QUICK, "--epochs", "-1", "--out", "r"),
         "epochs must be at least 1"),
    Case("distill", "non-numeric --epochs", ("distill", *S, *D, "--epochs", "abc"), "Invalid value for '--epochs'"),
    Case("distill", "--lr nan", ("distill", *S, *D, *QUICK, "--lr", "nan", "--out", "r"), "lr: nan is not a finite"),
    Case("distill", "--lr inf", ("distill", *S, *D, *QUICK, "--lr", "inf", "--out", "r"), "lr: inf is not a finite"),
    Case("distill", "--kd-weight nan", ("distill", *S, *D, *QUICK, "--kd-weight", "nan", "--out", "r"),
         "kd_weight: nan is not a finite"),
    Case("distill", "--device mps on a machine without it", ("distill", *S, *D, *QUICK, "--device", "mps", "--out",
                                                             "r"), "mps is not available on this machine"),
    Case("distill", "--set opt=nosuchopt", ("distill", *S, *D, *QUICK, "--set", "opt=nosuchopt", "--out", "r"),
         "recipe opt: unknown 'nosuchopt'"),
    Case("distill", "--set sched=nosuch", ("distill", *S, *D, *QUICK, "--set", "sched=nosuch", "--out", "r"),
         "recipe sched: unknown 'nosuch'"),
    Case("distill", "--set clip_mode=foo", ("distill", *S, *D, *QUICK, "--set", "clip_mode=foo", "--out", "r"),
         "recipe clip_mode: unknown 'foo'; valid: norm, value, agc"),
    Case("distill", "--set smoothing=2", ("distill", *S, *D, *QUICK, "--set", "smoothing=2", "--out", "r"),
         "recipe smoothing"),
    Case("distill", "--set workers=-1", ("distill", *S, *D, *QUICK, "--set", "workers=-1", "--out", "r"),
         "recipe workers: -1 must not be negative"),
    Case("distill", "--set hflip=5", ("distill", *S, *D, *QUICK, "--set", "hflip=5", "--out", "r"),
         "hflip: 5.0 is a probability"),
    Case("distill", "--set scale=[1,0.5]", ("distill", *S, *D, *QUICK, "--set", "scale=[1,0.5]", "--out", "r"),
         "recipe scale"),
    Case("distill", "--set rand_augment=rand-m9-zzz1", ("distill", *S, *D, *QUICK, "--set",
                                                        "rand_augment=rand-m9-zzz1", "--out", "r"),
         "recipe rand_augment: timm cannot read"),
    Case("distill", "--set lr=[1", ("distill", *S, *D, *QUICK, "--set", "lr=[1", "--out", "r"), "cannot read '[1'"),
    Case("distill", "--set seed past 64 bits", ("distill", *S, *D, *QUICK, "--set", "seed=99999999999999999999",
                                                "--out", "r"), "seed: 99999999999999999999 must be below 2**63"),
    Case("distill", "--set name with a path in it", ("distill", *S, *D, *QUICK, "--set", "name=../../escape"),
         "recipe name: '../../escape' must be a plain name"),
    Case("distill", "a stray WORLD_SIZE=2 (no torchrun)", ("distill", *S, *D, *QUICK, "--out", "r"),
         "WORLD_SIZE=2 is set but RANK or MASTER_ADDR is not", "world_size_2"),
    Case("distill", "a stray WORLD_SIZE=abc", ("distill", *S, *D, *QUICK, "--out", "r"),
         "WORLD_SIZE='abc' is not a positive integer", "world_size_abc"),
    Case("distill", "--push-to-hub with the Hub offline", ("distill", *S, *D, *QUICK, "--push-to-hub", "me/x",
                                                           "--out", "r"), "HF_HUB_OFFLINE is set"),
    Case("distill", "unknown recipe key", ("distill", *S, *D, *QUICK, "--set", "lrr=1", "--out", "r"),
         "unknown recipe key 'lrr'"),
    Case("distill", "--out an unrelated folder (--force)", ("distill", *S, *D, *QUICK, "--out", "{precious}",
                                                            "--force"), "not written by vitconvert"),
    Case("distill", "--out is the student (--force)", ("distill", *S, *D, *QUICK, "--out", "{student}", "--force"),
         "is the input"),
    Case("distill", "--out inside the data folder", ("distill", *S, *D, *QUICK, "--out", "{images}/run"),
         "is inside the input"),
    Case("distill", "--out an existing run, no --force", ("distill", *S, *D, *QUICK, "--out", "{run}"),
         "already exists; use --resume"),
    Case("distill", "--out in a read-only folder", ("distill", *S, *D, *QUICK, "--out", "/sys/vc-run"),
         "cannot write /sys/vc-run"),
    Case("distill", "--resume without a checkpoint", ("distill", *S, *D, *QUICK, "--resume", "--out", "r"),
         "has no checkpoint-last/"),
    Case("distill", "--resume with a different recipe", ("distill", *S, *D, *QUICK, "--lr", "0.5", "--resume",
                                                         "--out", "{run}"), "changed recipe (lr: 0.001 -> 0.5)"),
    Case("distill", "--resume on a finished run", ("distill", *S, *D, *QUICK, "--resume", "--out", "{run}"),
         "is complete (1 of 1 epochs)"),
    Case("distill", "--resume --force, truncated checkpoint model", ("distill", *S, *D, *QUICK, "--epochs", "2",
                                                                     "--resume", "--force", "--out", "../rc"),
         "checkpoint-last/model.safetensors: corrupt or truncated", "trunc_model"),
    Case("distill", "--resume --force, truncated optimizer state", ("distill", *S, *D, *QUICK, "--epochs", "2",
                                                                    "--resume", "--force", "--out", "../rc"),
         "checkpoint-last/optimizer.safetensors: corrupt or truncated", "trunc_optimizer"),
    Case("distill", "--resume --force, truncated RNG state", ("distill", *S, *D, *QUICK, "--epochs", "2",
                                                              "--resume", "--force", "--out", "../rc"),
         "checkpoint-last/rng.safetensors: corrupt or truncated", "trunc_rng"),
    Case("distill", "--resume --force, missing optimizer state", ("distill", *S, *D, *QUICK, "--epochs", "2",
                                                                  "--resume", "--force", "--out", "../rc"),
         "optimizer.safetensors is missing", "no_optimizer"),
    Case("distill", "--resume, trainer.json without its fields", ("distill", *S, *D, *QUICK, "--resume", "--out",
                                                                  "../rc"), "the checkpoint is damaged",
         "bad_trainer_json"),
    Case("distill", "--resume, checkpoint-last/ without trainer.json", ("distill", *S, *D, *QUICK, "--resume",
                                                                        "--out", "../rc"),
         "has no trainer.json: the checkpoint is damaged", "half_run"),
    Case("distill", "--resume, a negative position in trainer.json", ("distill", *S, *D, *QUICK, "--resume",
                                                                      "--out", "../rc"), "the checkpoint is damaged",
         "negative_position"),
    # -- compare, bench, push, quickstart --------------------------------------------------------------
    Case("compare", "missing student", ("compare", "nope", *D), "not found"),
    Case("compare", "a softmax folder as student", ("compare", "{teacher}", *D), "not a vitconvert model folder"),
    Case("compare", "a text file as student", ("compare", "{afile}", *D), "is a file, not a model folder"),
    Case("compare", "an unknown --split", ("compare", *S, "--data", "digits", "--split", "nosuch"),
         "digits has no 'nosuch' split"),
    Case("compare", "missing data folder", ("compare", *S, "--data", "nope"), "not found"),
    Case("bench", "missing source", ("bench", "./nope/", "--no-pretrained"), "not found"),
    Case("bench", "unknown variant", ("bench", "{teacher}", "--to", "nosuch"), "unknown variant"),
    Case("bench", "VITCONVERT_FUSED_CONFIG=33,4", ("bench", "{teacher}", "--to", "elu"),
         "VITCONVERT_FUSED_CONFIG='33,4': expected BLOCK_N,num_warps", "env:VITCONVERT_FUSED_CONFIG=33,4"),
    Case("bench", "VITCONVERT_FUSED_TILE=bf16", ("bench", "{teacher}", "--to", "elu"),
         "VITCONVERT_FUSED_TILE='bf16': expected one of tf32, half", "env:VITCONVERT_FUSED_TILE=bf16"),
    Case("bench", "VITCONVERT_MHLA_FORM=flash", ("bench", "{teacher}", "--to", "mhla"),
         "VITCONVERT_MHLA_FORM='flash': expected one of auto, pairwise, blocked", "env:VITCONVERT_MHLA_FORM=flash"),
    Case("bench", "non-numeric --repeats", ("bench", "{teacher}", "--repeats", "x"), "Invalid value for '--repeats'"),
    Case("bench", "--keep-softmax every layer", ("bench", "{teacher}", "--to", "elu", "--keep-softmax", "0,1",
                                                 "--repeats", "1"), "keeps all 2 layers softmax"),
    # -- files other than folders: plots and exports (issue 23) --------------------------------------------
    Case("compare", "--plot the student's weights (--force)", ("compare", *S, *D, "--plot",
                                                               "{student}/model.safetensors", "--force"),
         "does not end in .png"),
    Case("compare", "--plot the teacher's config.json (--force)", ("compare", *S, *D, "--plot",
                                                                   "{teacher}/config.json", "--force"),
         "does not end in .png"),
    Case("compare", "--plot a PNG vitconvert did not write (--force)", ("compare", *S, *D, "--plot", "{photo}",
                                                                        "--force"), "not written by vitconvert"),
    Case("compare", "--plot inside the student", ("compare", *S, *D, "--plot", "{student}/gaps.png"),
         "is inside the input"),
    Case("compare", "--plot a folder", ("compare", *S, *D, "--plot", "{precious}"), "is a folder"),
    Case("compare", "--plot below a file", ("compare", *S, *D, "--plot", "{afile}/gaps.png"),
         "is a file, not a folder"),
    Case("compare", "--plot in a read-only folder", ("compare", *S, *D, "--plot", "/sys/vc-plot.png"),
         "cannot write /sys/vc-plot.png"),
    Case("bench", "--plot another model's weights (--force)", ("bench", "{teacher}", "--plot",
                                                               "{student}/model.safetensors", "--force"),
         "does not end in .png"),
    Case("export", "--out another model's weights (--force)", ("export", *S, "--out", "{teacher}/model.safetensors",
                                                               "--force"), "does not end in .onnx"),
    Case("export", "--out an unrelated text file (--force)", ("export", *S, "--out", "{afile}", "--force"),
         "does not end in .onnx"),
    Case("export", "--out an .onnx file vitconvert did not write (--force)", ("export", *S, "--out", "{useronnx}",
                                                                              "--force"), "not written by vitconvert"),
    Case("export", "--format onnx --out x.pt2", ("export", *S, "--out", "x.pt2"), "does not end in .onnx"),
    Case("export", "--format pt2 --out x.onnx", ("export", *S, "--format", "pt2", "--out", "x.onnx"),
         "does not end in .pt2"),
    Case("push", "missing folder", ("push", "nope", "--repo", "me/x", "--dry-run"), "not found"),
    Case("push", "a softmax folder", ("push", "{teacher}", "--repo", "me/x", "--dry-run"), "vitconvert"),
    Case("push", "a repo id without org", ("push", *S, "--repo", "noslash", "--dry-run"), "repo"),
    Case("push", "a revision git refuses (--dry-run)", ("push", *S, "--repo", "me/x", "--revision", "a..b",
                                                        "--dry-run"), "--revision: 'a..b' is not a git branch name"),
    Case("push", "a student timm's save_for_hf wrote", ("push", "{timmsaved}", "--repo", "me/x", "--dry-run"),
         "makes it a full vitconvert folder"),
    Case("upgrade", "missing folder (local-dir:)", ("upgrade", "local-dir:nope"), "folder not found: nope"),
    Case("upgrade", "a Hub repo (hf-hub:)", ("upgrade", "hf-hub:me/x"), "hf-hub:me/x is a Hub repo: upgrade rewrites"),
    Case("upgrade", "a softmax folder", ("upgrade", "{teacher}"), "is not a vitconvert folder"),
    Case("quickstart", "unknown variant", ("quickstart", "--variants", "nosuch", "--out", "q"), "nosuch"),
    Case("quickstart", "--out an unrelated folder (--force)", ("quickstart", "--variants", "elu", "--epochs", "1",
                                                               "--out", "{precious}", "--force"),
         "holds files vitconvert did not write"),
    Case("list", "unknown flag", ("list", "--nosuch"), "No such option"),
    Case("vitconvert", "unknown command", ("nosuchcommand",), "No such command"),
]


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


def run_case(case: Case, workspace: dict[str, Path], cwd: Path, monkeypatch):
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    if case.prepare == "disk_full":
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
    lines = result.stderr.strip().splitlines()
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
    time.sleep(0.3)
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
