"""The cases of the bad-input sweep (tests/cli/test_bad_input.py): what the user got wrong, the command, the
fragment of its one error line, and how a case's folder is damaged first. docs/bad-input.md's table is written
from CASES."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from distill.helpers import FAST

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


def bad_set(value: str, message: str, given: str = "") -> Case:
    """A quick distill of the student on the images into ./r whose one fault is ``--set value``."""
    return Case("distill", given or f"--set {value}", ("distill", *S, *D, *QUICK, "--set", value, "--out", "r"),
                message)


def damaged_resume(given: str, message: str, prepare: str) -> Case:
    """``distill --resume --force`` to two epochs of ../rc: a copy of the one-epoch run, damaged by ``prepare``."""
    return Case("distill", given, ("distill", *S, *D, *QUICK, "--epochs", "2", "--resume", "--force", "--out", "../rc"),
                message, prepare)


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
    # -- the network and the Hub: offline, unreachable, misaddressed --------------------------------------------
    Case("convert", "an uncached hf-hub: repo with HF_HUB_OFFLINE=1", ("convert", "hf-hub:me/not-cached", "--to",
                                                                       "elu", "--out", "o"),
         "me/not-cached is not in the Hub cache and HF_HUB_OFFLINE is set", "empty_hub_cache"),
    Case("convert", "a pretrained timm name, HF_HUB_OFFLINE=1, an empty cache", ("convert", "vit_tiny_patch16_224",
                                                                                "--to", "elu", "--out", "o"),
         "HF_HUB_OFFLINE is set and timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k is not in the Hub cache",
         "empty_hub_cache"),
    Case("convert", "an hf-hub: repo, the Hub unreachable", ("convert", "hf-hub:me/not-cached", "--to", "elu", "--out",
                                                            "o"),
         "cannot reach the Hugging Face Hub to get me/not-cached (", "hub_unreachable"),
    Case("convert", "HF_ENDPOINT=hub.local (no scheme)", ("convert", "{teacher}", "--to", "elu", "--out", "o"),
         "HF_ENDPOINT='hub.local' is not a Hub address", "env:HF_ENDPOINT=hub.local"),
    Case("eval", "--download with no network", ("eval", *S, "--data", "torch/cifar10", "--download", "--data-dir",
                                                "dd"),
         "cannot download torch/cifar10 into dd: the network does not answer", "no_network"),
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
    Case("convert", "a .pth that is no torch file (--arch)",
         ("convert", "{garbagepth}", "--arch", "vit_tiny_patch16_224", "--to", "elu", "--out", "o"),
         "garbage.pth: corrupt or truncated torch weights file (not a torch file)"),
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
    Case("distill", "--stages attn:0steps,finetune", ("distill", *S, *D, *QUICK, "--stages", "attn:0steps,finetune",
                                                     "--out", "r"), "needs at least one step"),
    Case("distill", "--stages attn:60stp,finetune", ("distill", *S, *D, *QUICK, "--stages", "attn:60stp,finetune",
                                                    "--out", "r"), "whole number of epochs"),
    Case("distill", "--stages in steps longer than the run", ("distill", *S, *D, *QUICK, "--stages",
                                                               "attn:500steps,finetune", "--out", "r"),
         "do not fit in 1 epoch of 3 optimizer steps"),
    Case("distill", "--fsdp with --set attn_loss=weight_ce", ("distill", *S, *D, *QUICK, "--set", "attn_loss=weight_ce",
                                                              "--fsdp", "--out", "r"), "does not run under --fsdp"),
    Case("distill", "--set attn_loss=weight_ce with an InLine student (as MHLA, TTT)",
         ("distill", "{inline}", *D, *QUICK, "--set", "attn_loss=weight_ce", "--out", "r"),
         "needs attention weights that are a normalised kernel"),
    Case("distill", "non-numeric --epochs", ("distill", *S, *D, "--epochs", "abc"), "Invalid value for '--epochs'"),
    Case("distill", "--lr nan", ("distill", *S, *D, *QUICK, "--lr", "nan", "--out", "r"), "lr: nan is not a finite"),
    Case("distill", "--lr inf", ("distill", *S, *D, *QUICK, "--lr", "inf", "--out", "r"), "lr: inf is not a finite"),
    Case("distill", "--kd-weight nan", ("distill", *S, *D, *QUICK, "--kd-weight", "nan", "--out", "r"),
         "kd_weight: nan is not a finite"),
    Case("distill", "--device mps on a machine without it", ("distill", *S, *D, *QUICK, "--device", "mps", "--out",
                                                             "r"), "mps is not available on this machine"),
    bad_set("opt=nosuchopt", "recipe opt: unknown 'nosuchopt'"),
    bad_set("sched=nosuch", "recipe sched: unknown 'nosuch'"),
    bad_set("clip_mode=foo", "recipe clip_mode: unknown 'foo'; valid: norm, value, agc"),
    bad_set("smoothing=2", "recipe smoothing"),
    bad_set("workers=-1", "recipe workers: -1 must not be negative"),
    bad_set("hflip=5", "hflip: 5.0 is a probability"),
    bad_set("scale=[1,0.5]", "recipe scale"),
    bad_set("rand_augment=rand-m9-zzz1", "recipe rand_augment: timm cannot read"),
    bad_set("lr=[1", "cannot read '[1'"),
    bad_set("seed=99999999999999999999", "seed: 99999999999999999999 must be below 2**63", "--set seed past 64 bits"),
    Case("distill", "--set name with a path in it", ("distill", *S, *D, *QUICK, "--set", "name=../../escape"),
         "recipe name: '../../escape' must be a plain name"),
    Case("distill", "a stray WORLD_SIZE=2 (no torchrun)", ("distill", *S, *D, *QUICK, "--out", "r"),
         "WORLD_SIZE=2 is set but RANK or MASTER_ADDR is not", "world_size_2"),
    Case("distill", "a stray WORLD_SIZE=abc", ("distill", *S, *D, *QUICK, "--out", "r"),
         "WORLD_SIZE='abc' is not a positive integer", "world_size_abc"),
    Case("distill", "--push-to-hub with the Hub offline", ("distill", *S, *D, *QUICK, "--push-to-hub", "me/x",
                                                           "--out", "r"), "HF_HUB_OFFLINE is set"),
    bad_set("lrr=1", "unknown recipe key 'lrr'", "unknown recipe key"),
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
    damaged_resume("--resume --force, truncated checkpoint model",
                   "checkpoint-last/model.safetensors: corrupt or truncated", "trunc_model"),
    damaged_resume("--resume --force, truncated optimizer state",
                   "checkpoint-last/optimizer.safetensors: corrupt or truncated", "trunc_optimizer"),
    damaged_resume("--resume --force, truncated RNG state",
                   "checkpoint-last/rng.safetensors: corrupt or truncated", "trunc_rng"),
    damaged_resume("--resume --force, missing optimizer state", "optimizer.safetensors is missing", "no_optimizer"),
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
    Case("info", "--kernels --gpu h900 (no such GPU)", ("info", *S, "--kernels", "--gpu", "h900"),
         "--gpu: one of h100, h200, a100, l40, l4, a10, t4, v100, got 'h900'"),
    Case("info", "--kernels --dtype fp8", ("info", *S, "--kernels", "--dtype", "fp8"),
         "--dtype: one of bfloat16, float16, float32, got 'fp8'"),
]
