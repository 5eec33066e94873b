"""Every command of README.md's and docs/*.md's ```bash blocks, run in order in one empty folder (issue 23).

Offline and in minutes: each command goes through OFFLINE, a table of substitutions that replace what needs a
network, a GPU cluster or hours (pretrained deit_small -> a random deit_tiny, the Hub -> local folders,
cifar100/imagenet -> the bundled digits, 300-epoch recipes -> one epoch of the quickstart recipe). Synopsis
lines (``[--flag]``, SOURCE-style placeholders, ``...``) are documentation, not commands. What cannot run
here at all is in SKIP, with the reason. Every other command must exit 0 — so a block that collides with an
earlier one (the same default folder twice) fails here. Marked slow (a few minutes of CPU):
``python -m pytest tests/test_docs_commands.py -m slow``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

SKIP = {  # a pattern of the command -> why it cannot run offline on a CPU
    r"^pip install": "installs packages (the test runs in the installed environment)",
    r"^python -m pytest": "the test suite itself",
    r"vitconvert push (?!.*--dry-run)": "uploads to the Hub (needs a network and a token)",
    r"hf-hub:me/": "reads a repository of the reader's own on the Hub",
    r"--nnodes 2": "two machines",
    r"--resume": "continues a run stopped by Ctrl-C (tests/cli/test_dead_ends.py stops and resumes one)",
    r"device_check\.sh|gpu_check\.py(?!.*--device cpu)": "needs an NVIDIA GPU",
    r"^python benchmarks/(speed|distill_overhead|default_recipe|quickstart_results|reproduce|frontier|budget)\.py":
        "measures for minutes to hours and rewrites a results file and a doc's table (tests/test_doc_tables.py "
        "holds the tables to their results files)",
}
OFFLINE = [  # (pattern, replacement), applied in order
    (r"hf-hub:timm/deit_tiny_patch16_224\.fb_in1k", "deit_tiny --no-pretrained --img-size 32"),
    (r"^vitconvert convert deit_small\b", "vitconvert convert deit_small --no-pretrained --img-size 32"),
    (r"^(vitconvert convert deit_small(?!.*--num-classes).*)$", r"\1 --num-classes 10"),  # digits' classes
    (r"--num-classes 100\b", "--num-classes 10"),
    (r"--data (torch/cifar100|/data/imagenet)", "--data digits"),
    (r" --data-dir /data| --download", ""),
    (r"--recipe (cifar100|imagenet1k)", r"--recipe \1 --epochs 1 --batch-size 64 --data digits --set img_size=32"),
    (r"--nproc_per_node 8", "--nproc_per_node 2"),
    (r"^vitconvert quickstart$", "vitconvert quickstart --variants elu --epochs 1 --no-scratch"),
    (r"--img-size 224,512,1024|--img-size 224,1024", "--img-size 32,64"),
    (r"--img-size 512\b", "--img-size 64"),
    (r"--backend onnxruntime --threads 1 --repeats 5", "--backend onnxruntime --threads 1 --repeats 1 --img-size 32"),
]
SYNOPSIS = re.compile(r"\[|\.\.\.|\b(SOURCE|STUDENT|FOLDER|MODEL|DATA|VARIANT|DIR|ORG/NAME)\b")


def commands(page: Path) -> list[str]:
    """The page's bash blocks as single commands: continuations joined, comments and `&&` chains split."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            found += [part.strip() for part in line.split("&&") if part.strip()]
    return found


def offline(command: str) -> str:
    for pattern, replacement in OFFLINE:
        command = re.sub(pattern, replacement, command)
    return command


def setup_folder(root: Path) -> None:
    """What the docs assume the reader has: a timm folder, a bare weights file, a converted TTT model (the
folders' names are the docs'; the Hub and the data are replaced by OFFLINE)."""
    import timm
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    timm.models.save_for_hf(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                              embed_dim=32, depth=2, num_heads=2),
                            str(root / "my_timm_folder"), safe_serialization=True)
    weights = timm.create_model("vit_small_patch16_224", pretrained=False).state_dict()
    save_file(weights, str(root / "weights.safetensors"))
    converted = subprocess.run([sys.executable, "-m", "vitconvert", "convert", "digits", "--to", "ttt", "--out",
                                "my-model-ttt"], cwd=root, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert converted.returncode == 0


def all_commands() -> list[tuple[str, str]]:
    return [(f"{page.relative_to(REPO)}: {c}", c) for page in PAGES for c in commands(page)]


def test_the_pages_have_commands():
    listed = all_commands()
    assert len(listed) > 30 and any("vitconvert distill" in c for _, c in listed)


def flags(command: str) -> list[str]:
    return re.findall(r"(?<![\w-])--[a-z][\w-]*", command)


def cli_options() -> dict[str, set[str]]:
    """vitconvert's subcommands -> every option name each takes (typer's own commands, as the CLI builds them)."""
    import typer

    from vitconvert.cli import app

    group = typer.main.get_command(app)
    return {name: {o for p in command.load().params for o in (*p.opts, *p.secondary_opts)}
            for name, command in group.commands.items()}


@pytest.mark.parametrize("page", ["README.md", "docs/performance.md"])
def test_every_command_on_the_page_names_a_real_subcommand_flag_and_script(page):
    """Fast (no command runs): each vitconvert command's subcommand and flags are the CLI's, each benchmark script
    exists and defines each flag given to it. The slow test below runs them."""
    options, wrong = cli_options(), []
    for command in commands(REPO / page):
        words = command.split()
        if "vitconvert" in words and words.index("vitconvert") + 1 < len(words):
            sub, *rest = words[words.index("vitconvert") + 1:]
            if sub.startswith("--"):
                wrong += [f"{command}: {f}" for f in flags(" ".join(words)) if f not in ("--version", "--help")]
            elif sub not in options:
                wrong.append(f"{command}: no command {sub}")
            else:
                wrong += [f"{command}: {sub} has no {f}" for f in flags(" ".join(rest))
                          if f not in options[sub] | {"--help"}]
        script = next((w for w in words if w.startswith("benchmarks/")), None)
        if script is not None:
            source = REPO / script
            if not source.is_file():
                wrong.append(f"{command}: no file {script}")
            elif source.suffix == ".py":
                text = source.read_text()
                wrong += [f"{command}: {script} has no {f}" for f in flags(command) if f'"{f}"' not in text]
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_every_documented_command_runs_offline_in_order(tmp_path):
    setup_folder(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    prefix = {"vitconvert": [sys.executable, "-m", "vitconvert"],
              "torchrun": [sys.executable, "-m", "torch.distributed.run"], "python": [sys.executable]}
    ran, skipped, failed = [], [], []
    for where, command in all_commands():
        if SYNOPSIS.search(command):
            continue
        reason = next((why for pattern, why in SKIP.items() if re.search(pattern, command)), None)
        if reason:
            skipped.append(f"{where} ({reason})")
            continue
        argv = shlex.split(offline(command))
        argv = [*prefix.get(argv[0], [argv[0]]), *[a.replace("benchmarks/", f"{REPO}/benchmarks/") for a in argv[1:]]]
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        ran.append(where)
        if result.returncode != 0:
            failed.append(f"{where}\n  -> {offline(command)}\n  exit {result.returncode}: "
                          f"{(result.stderr.strip().splitlines() or [''])[-1]}")
    assert not failed, "\n".join(failed)
    assert len(ran) > 20, (ran, skipped)
