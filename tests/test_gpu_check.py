"""benchmarks/gpu_check.py: its CPU dry run end to end (a real process), and its verdicts and cost by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_benchmark

from vitconvert.attention import VARIANTS
from vitconvert.attention.ops import dispatch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def load_script():
    return load_benchmark("gpu_check")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check") / "check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out),
                           "--budget-s", "3600"],  # every section, however loaded the machine (default: 240 s)
                          capture_output=True, text=True, timeout=600)
    return done, json.loads(out.read_text()) if out.is_file() else None


def test_dry_run_exits_cleanly_and_says_it_is_a_dry_run(dry_run):
    done, check = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert check["dry_run"] is True and check["errors"] == []
    assert "DRY RUN" in done.stdout and check["env"]["device"] == "cpu"
    triton_version = dispatch.triton_version()  # (kernels build differently across Triton versions)
    assert triton_version is not None and check["env"]["triton"] == triton_version


def test_dry_run_measures_every_variant_eager_and_compiled_with_targets_never_judged(dry_run):
    plan = load_script().QUICK
    rows = dry_run[1]["speed"]
    eager = {(r["img_size"], r["mode"], r["model"]) for r in rows if r["compile"] is None}
    assert eager == {(s, m, v) for s in plan.sizes for m in ("infer", "train") for v in ["softmax", *VARIANTS]}
    compiled = {(r["img_size"], r["model"]) for r in rows if r["compile"] == "eager"}
    assert compiled == {(s, v) for s in plan.compile_sizes for v in ["softmax", *VARIANTS]}
    assert all(r["amp"] == "bfloat16" and r["img_per_s"] > 0 and r["peak_mem_mb"] > 0 for r in rows)
    assert all(r["softmax_sdpa"] for r in rows)  # the baseline is timm's fused attention
    target_of = load_script().target_of
    for r in rows:
        assert r["verdict"] == ("dry run" if r["model"] != "softmax" else "—")
        assert r["target"] == (target_of(plan.targets, r["img_size"], r["model"]) if r["model"] != "softmax" else None)
        assert r["memory_verdict"] == ("dry run" if r["model"] != "softmax" and r["mode"] == "train" else "—")
    assert any("fla" in s and "CUDA only" in s for s in dry_run[1]["skipped"])


def test_dry_run_checks_bf16_distills_resumes_and_costs(dry_run):
    check = dry_run[1]
    assert {p["model"] for p in check["precision"]} == {"softmax", *VARIANTS}
    assert all(p["finite"] and 0 < p["rel_error"] < 0.05 for p in check["precision"])
    d = check["distill"]
    assert d["ok"] and d["resumed"] and "SIGTERM" in d["stopped"]
    assert d["steps"] == d["expected_steps"] and d["last_loss"] < d["first_loss"]
    assert {c["recipe"] for c in check["cost"]} == {"imagenet1k", "cifar100"}
    assert {c["model"] for c in check["cost"]} == {"softmax", *VARIANTS}


def test_verdict_passes_at_the_target_and_fails_below_it():
    verdict = load_script().verdict
    targets = {224: 0.9, 1024: 2.0}
    assert verdict({"model": "elu", "img_size": 1024, "speedup": 2.0}, targets, False) == (2.0, "pass")
    assert verdict({"model": "elu", "img_size": 1024, "speedup": 1.99}, targets, False) == (2.0, "FAIL")
    assert verdict({"model": "elu", "img_size": 224, "speedup": 0.5}, targets, True) == (0.9, "dry run")
    assert verdict({"model": "elu", "img_size": 512, "speedup": 0.5}, targets, False) == (None, "—")
    assert verdict({"model": "softmax", "img_size": 1024, "speedup": 1.0}, targets, False) == (None, "—")


def test_cost_is_epochs_times_images_times_teacher_and_student_seconds():
    script = load_script()
    plan = script.QUICK
    size = plan.sizes[0]
    rows = [{"source": plan.models[0], "img_size": size, "compile": None, "fla": False, "model": m, "mode": mode,
             "img_per_s": s} for m, mode, s in (("softmax", "infer", 400.0), ("elu", "train", 100.0))]
    (cifar,) = [c for c in script.cost(rows, plan) if c["recipe"] == "cifar100"]
    assert cifar["model"] == "elu" and cifar["epochs"] == 300 and cifar["images"] == 50_000
    assert cifar["gpu_hours"] == pytest.approx(300 * 50_000 * (1 / 400 + 1 / 100) / 3600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line_error(tmp_path):
    """As a user runs it (a process): refused before timm and vitconvert load (seconds), with one line."""
    done = subprocess.run([sys.executable, "-X", "importtime", str(SCRIPT), "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120)
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:") and line.count("|") == 2}
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and not (tmp_path / "x.json").exists()
    assert len(said) == 1 and said[0].startswith("error: ") and "no CUDA GPU" in said[0], said
    assert "torch" in imported and not imported & {"timm", "vitconvert"}, sorted(imported & {"timm", "vitconvert"})


def test_spent_budget_skips_every_section_by_name_and_still_saves():
    script = load_script()
    saved = []
    check = script.run_check(script.QUICK, torch.device("cpu"), budget_s=-1, log=lambda text: None,
                             save=lambda c: saved.append(len(c.skipped)))
    labels = [label for label, *_ in script.speed_runs(script.QUICK)]
    assert check.speed == [] and check.distill == {} and check.errors == []
    speed = [label for label in labels if label.startswith("eager")]
    rest = [label for label in labels if not label.startswith("eager")]
    assert [s.split(":")[0] for s in check.skipped] == ["parity", "op-level", *speed, "bf16 vs fp32", "distill",
                                                         *rest]
    assert saved and saved[-1] == len(check.skipped)  # written after every section, and at the end


def test_full_plan_runs_what_matters_most_first():
    script = load_script()
    labels = [label for label, *_ in script.speed_runs(script.FULL)]
    assert labels[:4] == [f"eager deit_small {size}px" for size in (224, 512, 1024, 2048)]
    assert labels.index("compiled deit_small 1024px") < labels.index("compiled deit_small 224px")
    assert labels.index("compiled deit_small 224px") < labels.index("models deit_tiny 224px")
    assert labels[-1] == "models deit_base 2048px"
    assert {label.split()[1] for label in labels if label.startswith("eager")} == {"deit_small"}
    assert {label.split()[1] for label in labels if label.startswith("models")} == {"deit_tiny", "deit_base"}
    assert {script.run_section(label) for label in labels} == {"speed", "compiled", "fla", "models"}


def test_targets_of_the_issue():
    script = load_script()
    assert script.target_of(script.FULL.targets, 1024, "elu") == 2.5
    assert script.target_of(script.FULL.targets, 1024, "mhla") == 2.0
    assert script.target_of(script.FULL.targets, 2048, "ttt") == 6.0
    assert script.target_of(script.FULL.targets, 224, "relu") == 1.0
    assert script.target_of(script.FULL.targets, 512, "relu") is None
    assert script.FULL.op_targets == {4097: {"infer": 8.0, "train": 6.0}}


def test_only_the_sections_asked_for_run_and_each_is_saved_when_it_ends(monkeypatch):
    script = load_script()
    monkeypatch.setattr(script, "distill", lambda plan, device: {"ok": True, "steps": 4})
    saved = []
    check = script.run_check(script.QUICK, torch.device("cpu"), budget_s=600, log=lambda text: None,
                             save=lambda c: saved.append(json.loads(json.dumps(script.asdict(c)))),
                             sections=("op", "distill"))
    assert check.speed == [] and check.precision == [] and check.errors == [] and check.skipped == []
    assert saved[0]["op"] and saved[0]["distill"] == {}  # the op section, saved as soon as it ended
    assert saved[1]["distill"] == {"ok": True, "steps": 4}  # the distill section's own save holds its result
    ops = {(r["tokens"], r["mode"], r["model"]) for r in check.op}
    modes, models = ("infer", "train"), ["softmax", *VARIANTS, "mhla (pairwise)", "mhla (blocked)"]  # MHLA as
    # dispatch picks its form, and each form
    assert ops == {(n, m, v) for n in script.QUICK.op_tokens for m in modes for v in models}
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["gb_s"] > 0 for r in check.op)
    assert {r["verdict"] for r in check.op if r["tokens"] == 65 and r["model"] != "softmax"} == {"dry run"}


def test_unknown_section_is_one_line_error(tmp_path, capsys):
    """The script's main() in this process; the refusal's way out is the one a process takes (the test above)."""
    with pytest.raises(SystemExit) as stopped:
        load_script().main(["--device", "cpu", "--sections", "op,nosuch", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and not (tmp_path / "x.json").exists()
    assert "nosuch" in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_sizes_choose_the_speed_rows_and_their_batches():
    script = load_script()
    plan = script.with_sizes(script.FULL, "1024, 224,640")
    assert plan.sizes == (1024, 224, 640) and plan.batch == {1024: 16, 224: 256, 640: 31}  # 640: 224 px's tokens
    assert plan.targets == script.FULL.targets and plan.op_tokens == script.FULL.op_tokens
    for bad in ("", "224,abc", "225", "0"):
        with pytest.raises(ValueError, match="multiples of 16"):
            script.with_sizes(script.FULL, bad)


def test_dry_run_checks_the_kernels_against_the_eager_forms(dry_run):
    """parity, in Triton's interpreter on the CPU (TRITON_INTERPRET=1 reaches the script): every variant's step ran
    on the kernels, float32 within 1e-4 where the kernels take it (not TTT's), every op as its fake says."""
    rows = {r["model"]: r for r in dry_run[1]["parity"]}
    assert rows.keys() == set(VARIANTS) - {"mhla"} | {"mhla (pairwise)", "mhla (blocked)"}  # each of its forms
    for name, r in rows.items():
        assert r["verdict"] == "pass" and r["bf16_launches"] > 0 and r["fakes_differ"] == [], r
        assert r["pair_mismatches"] is None  # (the PTX on bf16 pairs: a GPU's check, the interpreter runs none)
        assert (r["fp32_launches"] > 0) == (name != "ttt"), r
        if name != "ttt":
            assert r["fp32_output_error"] < 1e-4 and r["fp32_grad_error"] < 1e-4, r


def test_parity_fails_a_kernel_that_computes_something_else():
    verdict = load_script().parity_verdict
    good = {"bf16_launches": 8, "fp32_output_error": 1e-7, "fp32_grad_error": 1e-6, "bf16_output_error": 7e-3,
            "bf16_grad_error": 1.2e-2, "eager_bf16_output_error": 7e-3, "eager_bf16_grad_error": 1.1e-2,
            "fakes_differ": []}
    assert verdict(good) == "pass"
    assert verdict({**good, "fp32_output_error": None, "fp32_grad_error": None}) == "pass"  # TTT: no float32 kernels
    assert verdict({**good, "bf16_launches": 0}) == "FAIL: no kernels ran"
    assert verdict({**good, "fp32_grad_error": 3e-3}) == "FAIL: float32"
    assert verdict({**good, "bf16_output_error": 0.3}) == "FAIL: bf16 output"
    assert verdict({**good, "bf16_grad_error": 2.5e-2}) == "FAIL: bf16 grad"  # more than 2× the eager step's
    assert verdict({**good, "fakes_differ": ["blocked_attention"]}) == "FAIL: fake"
    assert verdict({**good, "pair_mismatches": 0}) == "pass"  # (ELU's and ReLU's φ on bf16 pairs: pair_features.py)
    assert verdict({**good, "pair_mismatches": 3}) == "FAIL: φ on bf16 pairs (3 values)"
