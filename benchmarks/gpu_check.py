"""The CUDA paths in one short run: speed and memory against fused-SDPA softmax, bf16 error, distill, cost.

    python benchmarks/gpu_check.py                          # one GPU: about 6 minutes (--budget-s 240 caps it)
    python benchmarks/gpu_check.py --sections op,speed      # a subset (names below)
    python benchmarks/gpu_check.py --sizes 224,1024         # the speed rows at these image sizes only
    python benchmarks/gpu_check.py --device cpu --quick     # the dry run the test suite runs (seconds)

Sections, in order of importance (one not started before --budget-s is recorded as skipped; each is saved as
soon as it ends):
  parity     each variant's training step on the fused kernels against its eager form (the reference): float32
             (TF32 off) within 1e-4, bf16 autocast no further from the float32 eager step than the eager bf16 one
             (2×), and every fused op returning the dtype, shape and strides its fake gives torch.compile; the
             speed rows below mean nothing where this fails (on a CPU: the kernels in Triton's interpreter);
             MHLA in each form of its kernels (pairwise and blocked: VITCONVERT_MHLA_FORM);
  op         one attention layer (B=16, H=6, d=64) at N = 197…16385 tokens under bf16 autocast: each variant's
             token mixing (the fused Triton kernels where they apply) against PyTorch SDPA (FlashAttention),
             forward and forward+backward, with achieved TFLOP/s and GB/s; MHLA as dispatch picks its form and
             in each form (the rows that tune fused_pairwise.pairwise_is_cheaper);
  speed      deit_small (pretrained=False: speed does not depend on weights) converted to every variant:
             forward and training-step img/s and peak memory next to the softmax source (timm's fused_attn,
             i.e. SDPA) at 224/512/1024/2048 px under bf16 autocast, eager;
  precision  bf16 against fp32 features of each variant at 1024 px: relative error (bar: ≤ 1.2× softmax's);
  distill    50 steps of the real distill trainer on synthetic images (AMP, channels_last, --compile), stopped
             by SIGTERM at step 30 and resumed: the loss must fall and the resumed run must reach step 50;
  compiled   the speed rows with every model, softmax included, under torch.compile (compiled vs compiled);
  fla        the flash-linear-attention state path (VITCONVERT_FLA=1, elu/relu) where fla is installed;
  models     deit_tiny and deit_base, eager;
and the GPU-hours of the imagenet1k and cifar100 recipes from the measured img/s (after every section).
Targets (issue 21): 1024 px elu/relu/inline ≥ 2.5×, mhla/ttt ≥ 2.0×; 2048 px ≥ 6×; 224 px ≥ 1.0×; one
layer at 4097 tokens ≥ 8× forward, ≥ 6× forward+backward; training memory ≤ softmax's; GPU-hours ≤ softmax's.
On a CPU every verdict reads "dry run": those numbers check the script, not the targets. Batches start at a
size that fits an H200 (141 GB) and halve on out-of-memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch

if __name__ == "__main__" and not torch.cuda.is_available():  # parity's kernels on a CPU: before timm imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sections, one module each beside this one
from gpu_check_plan import FULL, QUICK, SECTIONS, Check, Plan, with_sizes  # noqa: E402  (torch only)


def refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def arguments(argv: Optional[list[str]]) -> tuple[argparse.Namespace, tuple[str, ...], torch.device, Plan]:
    """(args, sections, device, plan) of the command line; bad input is one error line and exit 2."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run)")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the dry run of the test suite")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="start no section after this many seconds (the default keeps a run near 6 minutes "
                             "on one H200: op, speed, precision and distill take about 3, compiled rows 1–2 each)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default benchmarks/results/...; with "
                                                                "--quick, the temporary folder)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all, in that order)")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated image sizes of the speed rows (default: the plan's, 224,512,1024,2048)")
    args = parser.parse_args(argv)
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        refuse(f"unknown section {unknown[0] if unknown else '(none)'!r}; valid: {', '.join(SECTIONS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        refuse("--device cuda but no CUDA GPU is available (a dry run: --device cpu --quick)")
    plan = QUICK if args.quick else FULL
    if args.sizes:
        try:
            plan = with_sizes(plan, args.sizes)
        except ValueError as e:
            refuse(str(e))
    return args, sections, device, plan


if __name__ == "__main__":
    arguments(None)  # bad input refused in a second or two, before timm and vitconvert load


import timm  # noqa: E402

# the sections, one module each beside this one (what tests and probe_kernels.py use from this module is imported
# here too: the names below are its API)
from gpu_check_cost import cost  # noqa: E402
from gpu_check_distill import distill  # noqa: E402
from gpu_check_op import mixer_step, op_level, token_mixers  # noqa: E402, F401
from gpu_check_parity import parity, parity_verdict  # noqa: E402, F401
from gpu_check_precision import precision  # noqa: E402
from gpu_check_speed import (  # noqa: E402, F401
    FLA_ENV,
    FLA_VARIANTS,
    fla_path,
    fla_version,
    measure_speed,
    memory_verdict,
    run_section,
    speed_runs,
    target_of,
    verdict,
)
from gpu_check_tables import print_tables  # noqa: E402
from rich.console import Console  # noqa: E402

from vitconvert.attention import VARIANTS  # noqa: E402
from vitconvert.attention.kernel import fla_enabled  # noqa: E402
from vitconvert.attention.ops import dispatch  # noqa: E402
from vitconvert.writer import write_text_atomic  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def environment(device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None, "timm": timm.__version__,
            "triton": dispatch.triton_version(), "fla": fla_version(), "python": platform.python_version()}


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


# -- the run ------------------------------------------------------------------------------------------
def run_check(plan: Plan, device: torch.device, budget_s: float, log: Callable[[str], None],
              save: Callable[[Check], None] = lambda check: None,
              sections: tuple[str, ...] = SECTIONS) -> Check:
    """The ``sections`` in order of importance while the budget lasts; ``save`` after each, so a killed run keeps
    what it found (each section's result is in ``check`` before it is saved)."""
    check = Check(environment(device), dry_run=device.type != "cuda", sections=list(sections))
    deadline = time.perf_counter() + budget_s
    fla_ready = device.type == "cuda" and fla_version() is not None

    def section(label: str, work: Callable[..., Any], *args: Any) -> None:
        if time.perf_counter() > deadline:
            check.skipped.append(f"{label}: --budget-s {budget_s:.0f} spent")
            save(check)
            return
        log(label)
        try:
            work(*args)
        except Exception as e:  # one broken path must not hide the others: the report says what raised
            check.errors.append(f"{label}: {first_line(e)}")
        finally:
            memory_verdict(check.speed, check.dry_run)
            check.cost = cost(check.speed, plan, check.dry_run)
            save(check)

    def judged_speed(model: str, size: int, variants: list[str], compiled: bool, fla: bool) -> None:
        for row in measure_speed(plan, model, size, variants, device, compiled, fla, log):
            row["target"], row["verdict"] = verdict(row, plan.targets, check.dry_run)
            check.speed.append(row)

    def judged_parity() -> None:  # a kernel that computes something else fails the run, as an error does
        check.parity = parity(plan, device)
        check.errors.extend(f"parity {r['model']}: {r['verdict']}" for r in check.parity if r["verdict"] != "pass")

    def into(attribute: str, work: Callable[..., Any]) -> Callable[..., None]:
        return lambda *args: setattr(check, attribute, work(*args))

    for name in SECTIONS:
        if name not in sections:
            continue
        if name == "parity":
            section("parity", judged_parity)
        elif name == "op":
            section("op-level", into("op", op_level), plan, device)
        elif name == "precision":
            section("bf16 vs fp32", into("precision", precision), plan, device)
        elif name == "distill":
            section("distill", into("distill", distill), plan, device)
        for label, model, size, compiled, fla in speed_runs(plan):
            if run_section(label) != name:
                continue
            if fla and not fla_ready:
                check.skipped.append(f"{label}: {'CUDA only' if device.type != 'cuda' else 'fla is not installed'}")
                continue
            variants = list(FLA_VARIANTS) if fla else list(VARIANTS)
            if fla:
                with fla_path(True):
                    if not fla_enabled(torch.empty(0, device=device)):
                        check.skipped.append(f"{label}: {FLA_ENV}=1 does not enable the fla path")
                        continue
            section(label, judged_speed, model, size, variants, compiled, fla)
    memory_verdict(check.speed, check.dry_run)
    check.cost = cost(check.speed, plan, check.dry_run)
    save(check)
    return check


def main(argv: Optional[list[str]] = None) -> int:
    args, sections, device, plan = arguments(argv)
    if plan.threads:  # every section on the plan's threads (the dry run: one core; torch's default of one thread
        torch.set_num_threads(plan.threads)  # per core only spins on the small steps of a shared machine)
    console = Console(width=None if sys.stdout.isatty() else 180)
    log = lambda text: console.log(text)  # noqa: E731
    results = Path(tempfile.gettempdir()) if args.quick else ROOT / "benchmarks" / "results"  # no dry run in the tree
    out = args.out or results / f"gpu-check-{device.type}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(check: Check) -> None:  # whole or not at all: a reader never sees half a file
        write_text_atomic(out, json.dumps(asdict(check), indent=1))

    check = run_check(plan, device, args.budget_s, log, save, sections)
    print_tables(check, console)
    console.print(f"wrote {out}")
    return 1 if check.errors else 0


if __name__ == "__main__":
    sys.exit(main())
