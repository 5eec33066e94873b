"""gpu_check's speed rows (eager, compiled, fla, other models): img/s and peak memory next to softmax's, judged
against the plan's targets."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Optional

import torch
from gpu_check_plan import MODEL_BATCH_SCALE, NOT_MEASURED, Plan, Targets, softmax_source

from vitconvert.attention import VARIANTS
from vitconvert.attention.kernel import KernelAttention
from vitconvert.attention.ops import dispatch
from vitconvert.bench import SOFTMAX, benchmark

FLA_ENV = "VITCONVERT_FLA"
FLA_VARIANTS = tuple(n for n, c in VARIANTS.items() if issubclass(c, KernelAttention))  # fla's kernel gives their state


def target_of(targets: Targets, size: int, model: str) -> Optional[float]:
    target = targets.get(size)
    return target.get(model) if isinstance(target, dict) else target


def verdict(row: dict[str, Any], targets: Targets, dry_run: bool) -> tuple[Optional[float], str]:
    """(target, "pass"/"FAIL"/"dry run"/"—") of one row: softmax rows and sizes without a target have none."""
    target = target_of(targets, row["img_size"], row["model"]) if row["model"] != SOFTMAX else None
    if target is None:
        return None, NOT_MEASURED
    if dry_run:
        return target, "dry run"
    return target, "pass" if row["speedup"] >= target else "FAIL"


def memory_verdict(rows: list[dict[str, Any]], dry_run: bool) -> None:
    """Each training row's ``memory_verdict``: its peak memory at most the softmax row's of the same setting."""
    softmax = {(r["source"], r["img_size"], r["compile"], r["fla"]): r["peak_mem_mb"] for r in rows
               if r["model"] == SOFTMAX and r["mode"] == "train"}
    for r in rows:
        limit = softmax.get((r["source"], r["img_size"], r["compile"], r["fla"]))
        if r["mode"] != "train" or r["model"] == SOFTMAX or limit is None or r["peak_mem_mb"] is None:
            r["memory_verdict"] = NOT_MEASURED
        else:
            r["memory_verdict"] = "dry run" if dry_run else ("pass" if r["peak_mem_mb"] <= limit else "FAIL")


def measure_speed(plan: Plan, model: str, size: int, variants: list[str], device: torch.device, compiled: bool,
                  fla: bool, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """One benchmark call (softmax and ``variants`` taking turns), the batch halved until it fits."""
    batch = max(1, int(plan.batch[size] * MODEL_BATCH_SCALE.get(model, 1.0)))
    softmax = softmax_source(plan, model, size)
    fused = [m.fused_attn for m in softmax.modules() if hasattr(m, "fused_attn")]
    while True:
        try:
            with fla_path(fla):
                report = benchmark(softmax, variants, batch_size=batch, train=True,
                                   repeats=plan.repeats, warmup=2, device=str(device), threads=plan.threads,
                                   amp="bfloat16", compile=plan.compile_backend if compiled else None, log=log)
            break
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            if batch == 1:
                raise
            batch //= 2
            log(f"out of memory: {model} {size} px, retrying at batch {batch}")
    setting = {"source": model, "compile": report.compile, "fla": fla, "amp": report.amp,
               "softmax_sdpa": bool(fused) and all(fused)}  # timm's fused_attn: F.scaled_dot_product_attention
    return [{**setting, **{k: v for k, v in asdict(r).items() if k != "times_ms"}} for r in report.rows]


def speed_runs(plan: Plan) -> Iterator[tuple[str, str, int, bool, bool]]:
    """(label, model, size, compiled, fla): the first model eager at every size, compiled at the compile sizes
    (most important first), with fla, then the other models eager. Labels start with the kind (run_section)."""
    first, *others = plan.models
    for size in plan.sizes:
        yield f"eager {first} {size}px", first, size, False, False
    for model in plan.compile_models:
        for size in plan.compile_sizes:
            yield f"compiled {model} {size}px", model, size, True, False
    for model in plan.fla_models:
        for size in plan.sizes:
            yield f"fla {model} {size}px", model, size, False, True
    for model in others:
        for size in plan.sizes:
            yield f"models {model} {size}px", model, size, False, False


def run_section(label: str) -> str:
    """The section a speed run belongs to, from its label (speed_runs)."""
    kind = label.split()[0]
    return "speed" if kind == "eager" else kind


def fla_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("flash-linear-attention")
    except Exception:
        return None


@contextmanager
def fla_path(on: bool) -> Iterator[None]:
    """VITCONVERT_FLA set for the models built and run inside, whatever the caller's environment says; with it
    on, the fused kernels off (VITCONVERT_FUSED=0: they would take the call before the fla state is reached)."""
    settings = {FLA_ENV: "1" if on else "0", dispatch.ENV: "0" if on else os.environ.get(dispatch.ENV)}
    before = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
