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
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

if __name__ == "__main__" and not torch.cuda.is_available():  # parity's kernels on a CPU: before timm imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import timm  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import vitconvert  # noqa: E402
from vitconvert.attention import VARIANTS, dispatch, fused, fused_pairwise  # noqa: E402
from vitconvert.attention.kernel import KernelAttention, fla_enabled  # noqa: E402
from vitconvert.bench import SOFTMAX, benchmark, linear_copy  # noqa: E402
from vitconvert.recipes import load_recipe  # noqa: E402
from vitconvert.sources import load_source  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLA_ENV = "VITCONVERT_FLA"
FLA_VARIANTS = tuple(n for n, c in VARIANTS.items() if issubclass(c, KernelAttention))  # fla's kernel gives their state
DATASET_IMAGES = {"imagenet1k": 1_281_167, "cifar100": 50_000}  # training images per epoch
NOT_MEASURED = "—"
SYNTHETIC_CLASSES = 4


Targets = dict[int, "float | dict[str, float]"]  # image size -> least speedup (one for all, or per variant)


@dataclass(frozen=True)
class Plan:
    """What one run measures; FULL fits a few minutes of one H200, QUICK a few seconds of one CPU core."""

    models: tuple[str, ...]
    sizes: tuple[int, ...]
    targets: Targets
    batch: dict[int, int]  # image size -> starting batch of deit_small (tiny doubles it, base halves it)
    repeats: int
    compile_backend: str
    compile_models: tuple[str, ...]
    compile_sizes: tuple[int, ...]  # the most important first
    fla_models: tuple[str, ...]
    precision_size: int
    distill_size: int
    distill_batch: int
    distill_steps: int  # per epoch; two epochs, stopped in the second and resumed
    distill_compile: bool
    workers: int
    threads: Optional[int]
    depth: Optional[int] = None  # blocks of every model; None: the architecture's own (12)
    op_tokens: tuple[int, ...] = (197, 1025, 4097, 16385)  # N of the op section (a class token + a square grid)
    op_shape: tuple[int, int, int] = (16, 6, 64)  # (batch, heads, head dim) of the op section: deit_small's layer
    op_targets: dict[int, dict[str, float]] = field(default_factory=lambda: {4097: {"infer": 8.0, "train": 6.0}})
    op_repeats: int = 10
    parity_size: int = 224  # px of the parity section's model (models[0], 2 blocks)
    parity_batch: int = 2


TARGETS_1024 = {"elu": 2.5, "relu": 2.5, "inline": 2.5, "mhla": 2.0, "ttt": 2.0}
FULL = Plan(("deit_small", "deit_tiny", "deit_base"), (224, 512, 1024, 2048),
            {224: 1.0, 1024: TARGETS_1024, 2048: 6.0}, {224: 256, 512: 64, 1024: 16, 2048: 4}, repeats=5,
            compile_backend="inductor", compile_models=("deit_small",), compile_sizes=(1024, 224),
            fla_models=("deit_small",), precision_size=1024, distill_size=224, distill_batch=64, distill_steps=25,
            distill_compile=True, workers=8, threads=None)
# The dry run: the same code on a CPU at toy sizes; dynamo's "eager" backend traces without a C++ build.
QUICK = Plan(("deit_tiny",), (32, 64), {32: 1.0, 64: {**TARGETS_1024}}, {32: 2, 64: 2}, repeats=1,
             compile_backend="eager", compile_models=("deit_tiny",), compile_sizes=(32,), fla_models=("deit_tiny",),
             precision_size=64, distill_size=32, distill_batch=2, distill_steps=2, distill_compile=False, workers=0,
             threads=1, depth=2, op_tokens=(17, 65), op_shape=(2, 2, 16), op_targets={65: {"infer": 8.0, "train": 6.0}},
             op_repeats=1, parity_size=32, parity_batch=1)
MODEL_BATCH_SCALE = {"deit_tiny": 2.0, "deit_small": 1.0, "deit_base": 0.5}
SECTIONS = ("parity", "op", "speed", "precision", "distill", "compiled", "fla", "models")


@dataclass
class Check:
    """Everything one run found; ``skipped`` names sections not run and why, ``errors`` what raised."""

    env: dict[str, Any]
    dry_run: bool
    parity: list[dict[str, Any]] = field(default_factory=list)
    op: list[dict[str, Any]] = field(default_factory=list)
    speed: list[dict[str, Any]] = field(default_factory=list)
    precision: list[dict[str, Any]] = field(default_factory=list)
    distill: dict[str, Any] = field(default_factory=dict)
    cost: list[dict[str, Any]] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)  # the sections asked for
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def environment(device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None, "timm": timm.__version__,
            "triton": dispatch.triton_version(), "fla": fla_version(), "python": platform.python_version()}


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
    settings = {FLA_ENV: "1" if on else "0", fused.ENV: "0" if on else os.environ.get(fused.ENV)}
    before = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def softmax_source(plan: Plan, model: str, size: int, **kwargs: Any) -> torch.nn.Module:
    """The softmax model ``model`` (a timm name or alias) at ``size`` px with random weights."""
    depth = {"depth": plan.depth} if plan.depth else {}
    return load_source(model, pretrained=False, img_size=size, **depth, **kwargs).model


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


# -- parity: the kernels against the eager forms -------------------------------------------------------------
PARITY_FP32 = 1e-4  # fused vs eager in float32, TF32 off: the same math summed in another order
PARITY_BF16 = 2.0  # the fused bf16 step's error against the eager float32 one, at most this × the eager bf16 step's
# (rounding noise: over seeds the ratio went up to 1.4× in Triton's interpreter; a wrong kernel is off by O(1))


@contextmanager
def float32_matmuls() -> Iterator[None]:
    """TF32 off for matmuls and convolutions (float32 is then float32 on both paths), restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def training_step(model: torch.nn.Module, x: torch.Tensor, on_kernels: bool,
                  amp: Optional[torch.dtype]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(output, parameter gradients), float32, of one step of ``model`` (train mode) on the fused kernels or not."""
    for m in model.modules():
        if hasattr(m, "fused_kernels"):
            m.fused_kernels = on_kernels
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        out = model(x)
    out.float().square().mean().backward()
    return out.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖."""
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def step_error(got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict]) -> tuple[float, float]:
    """Relative error of the output, and of all parameter gradients as one vector (a parameter whose gradient is
    all but zero, as TTT's convs' at init, has a relative error of rounding noise alone)."""
    names = list(want[1])
    flat = [torch.cat([grads[n].flatten() for n in names]) for grads in (got[1], want[1])]
    return relative_error(got[0], want[0]), relative_error(*flat)


@contextmanager
def mhla_form(form: Optional[str]) -> Iterator[None]:
    """MHLA's kernels in one form inside (``VITCONVERT_MHLA_FORM``: pairwise or blocked); None: as dispatch picks
    by cost (fused_pairwise.pairwise_is_cheaper)."""
    saved = os.environ.get(dispatch.FORM_ENV)
    if form is not None:
        os.environ[dispatch.FORM_ENV] = form
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(dispatch.FORM_ENV, None)
        else:
            os.environ[dispatch.FORM_ENV] = saved


# each variant as dispatch runs it, MHLA in each of its kernels' forms (which one dispatch takes depends on the size)
PARITY_FORMS = (*((name, None) for name in VARIANTS if name != "mhla"), ("mhla", "pairwise"), ("mhla", "blocked"))


def form_label(name: str, form: Optional[str]) -> str:
    return name if form is None else f"{name} ({form})"


def parity(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    """Per variant: the fused step against the eager one in float32 (where the kernels take float32: not TTT's) and
    in bf16 autocast (against the eager float32 step, next to the eager bf16 step's own error), the kernels' launches
    counted and each op's output checked against its fake. On a CPU the kernels run in Triton's interpreter where
    it is on (TRITON_INTERPRET=1, set by this script without a GPU); without it there is nothing to compare."""
    if device.type != "cuda" and not dispatch.interpreting():
        raise RuntimeError("no kernels to check here: no GPU, and TRITON_INTERPRET=1 was not set before triton "
                           "was imported")
    torch.manual_seed(0)  # 2 blocks: the kernels' parity needs no depth, and each launch shape is built once
    softmax = load_source(plan.models[0], pretrained=False, img_size=plan.parity_size, depth=2).model.to(device)
    size = plan.parity_size
    x = torch.randn(plan.parity_batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    launches: list[Any] = []

    def counted(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
        launches.append(kernel)
        dispatch.build_and_run(kernel, grid, *args, **kwargs)

    rows = []
    with dispatch.launches_through(counted, device.type), float32_matmuls():
        for name, form in PARITY_FORMS:
            with mhla_form(form):
                rows.append(parity_row(name, form, softmax, x, plan, launches))
    return rows


def parity_row(name: str, form: Optional[str], softmax: torch.nn.Module, x: torch.Tensor, plan: Plan,
               launches: list[Any]) -> dict[str, Any]:
    """One variant's parity (``form``: MHLA's kernels forced into it): its fused steps (float32, bf16) against its
    eager ones, the launches counted."""
    model = linear_copy(softmax, name).to(x.device).train()
    eager32 = training_step(model, x, False, None)
    row: dict[str, Any] = {"model": form_label(name, form), "source": plan.models[0],
                           "img_size": plan.parity_size}
    launches.clear()
    fused32 = training_step(model, x, True, None)
    row["fp32_launches"] = len(launches)
    row["fp32_output_error"], row["fp32_grad_error"] = (step_error(fused32, eager32) if launches
                                                        else (None, None))
    launches.clear()
    with fused.fakes_checked() as differ:
        fused16 = training_step(model, x, True, torch.bfloat16)
    row["bf16_launches"], row["fakes_differ"] = len(launches), [repr(d) for d in differ]
    row["bf16_output_error"], row["bf16_grad_error"] = step_error(fused16, eager32)
    row["eager_bf16_output_error"], row["eager_bf16_grad_error"] = step_error(
        training_step(model, x, False, torch.bfloat16), eager32)
    row["verdict"] = parity_verdict(row)
    return row


def parity_verdict(row: dict[str, Any]) -> str:
    """'pass', or what failed: no kernels ran, float32 beyond PARITY_FP32, bf16 beyond PARITY_BF16 × eager's (with a
    floor of 1e-3: both near exact), an op's output unlike its fake."""
    failed = []
    if not row["bf16_launches"]:
        failed.append("no kernels ran")
    if row["fp32_output_error"] is not None and max(row["fp32_output_error"], row["fp32_grad_error"]) > PARITY_FP32:
        failed.append("float32")
    for what in ("output", "grad"):
        if row[f"bf16_{what}_error"] > max(PARITY_BF16 * row[f"eager_bf16_{what}_error"], 1e-3):
            failed.append(f"bf16 {what}")
    if row["fakes_differ"]:
        failed.append("fake")
    return "pass" if not failed else "FAIL: " + ", ".join(failed)


# -- op: one attention layer ------------------------------------------------------------------------------
def cuda_ms(step: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``step`` (CUDA events on a GPU, the wall clock on a CPU), after two warm-up calls."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def token_mixers(tokens: int, heads: int, head_dim: int, device: torch.device) -> dict[str, Callable[..., Any]]:
    """q, k, v -> o of SDPA and of each variant's ``mix`` (dispatch as in a model: fused kernels where they go)."""
    side = int(round((tokens - 1) ** 0.5))
    grid = (side, side)
    mixers: dict[str, Callable[..., Any]] = {SOFTMAX: lambda q, k, v: F.scaled_dot_product_attention(q, k, v)}
    for name, cls in VARIANTS.items():
        module = cls(heads * head_dim, heads, num_prefix_tokens=1, grid_size=grid).to(device)
        mixers[name] = lambda q, k, v, m=module: m.mix(q, k, v, None, grid)
        if name == "mhla":  # each form of its kernels as well: the rows that tune pairwise_is_cheaper's rule
            segments = module.block_counts[0] * module.block_counts[1] + 1  # (the blocks and the class token's)
            for form in dispatch.FORMS[1:]:
                if form != "pairwise" or segments <= fused_pairwise.MAX_SEGMENTS:  # (above, it runs blocked)
                    mixers[form_label(name, form)] = lambda q, k, v, m=module, f=form: forced(
                        f, m.mix, q, k, v, None, grid)
    return mixers


def forced(form: str, mix: Callable[..., Any], *args: Any) -> Any:
    with mhla_form(form):
        return mix(*args)


def mixer_step(mix: Callable[..., Any], mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               grad: torch.Tensor) -> Callable[[], None]:
    """One forward (no autograd) or forward+backward of ``mix`` under bf16 autocast."""
    autocast = torch.autocast(q.device.type, dtype=torch.bfloat16)
    if mode == "infer":
        def forward() -> None:
            with torch.no_grad(), autocast:
                mix(q, k, v)
        return forward
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def train() -> None:
        with autocast:
            out = mix(*leaves)
        out.backward(grad)
    return train


def op_level(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    """Forward and forward+backward of each token mixer on bf16 q, k, v (B, H, N, d), as autocast hands them over.

    FLOPs: softmax 4·N²·d per head forward (×3.5 with backward), linear 4·N·d² (×3); bytes: q, k, v, o once
    forward (+ o, dO read and dq, dk, dv written backward): what the fastest kernel must move, not what it does.
    """
    batch, heads, d = plan.op_shape
    rows = []
    for tokens in plan.op_tokens:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(batch, heads, tokens, d, generator=g).to(device, torch.bfloat16) for _ in range(3))
        grad = torch.randn(batch, heads, tokens, d, generator=g).to(device, torch.bfloat16)
        elements = batch * heads * tokens * d
        timings: dict[tuple[str, str], float] = {}
        for name, mix in token_mixers(tokens, heads, d, device).items():
            for mode in ("infer", "train"):
                try:
                    timings[name, mode] = cuda_ms(mixer_step(mix, mode, q, k, v, grad), device, plan.op_repeats)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    continue
                quadratic = name in (SOFTMAX, form_label("mhla", "pairwise"))
                flops = (4 * tokens * tokens * d if quadratic else 4 * tokens * d * d) * batch * heads
                flops *= 1.0 if mode == "infer" else (3.5 if quadratic else 3.0)
                moved = elements * 2 * (4 if mode == "infer" else 12)
                ms = timings[name, mode]
                softmax_ms = timings.get((SOFTMAX, mode))
                speedup = softmax_ms / ms if softmax_ms else None
                target = plan.op_targets.get(tokens, {}).get(mode) if name != SOFTMAX else None
                judged = NOT_MEASURED if target is None or speedup is None else (
                    "dry run" if device.type != "cuda" else ("pass" if speedup >= target else "FAIL"))
                rows.append({"tokens": tokens, "batch": batch, "heads": heads, "head_dim": d, "mode": mode,
                             "model": name, "ms": ms, "speedup": speedup, "tflops": flops / ms / 1e9,
                             "gb_s": moved / ms / 1e6, "target": target, "verdict": judged})
        del q, k, v, grad
    return rows


# -- 1. speed -----------------------------------------------------------------------------------------
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


# -- 2. bf16 against fp32 -----------------------------------------------------------------------------
def precision(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    """Relative error of bf16-autocast features against fp32 ones, and whether any is NaN/inf, per model."""
    size = plan.precision_size
    softmax = softmax_source(plan, plan.models[0], size).to(device).eval()
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for name in [SOFTMAX, *VARIANTS]:
        model = softmax if name == SOFTMAX else linear_copy(softmax, name).to(device).eval()
        with torch.inference_mode():
            exact = model.forward_features(x).float()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                half = model.forward_features(x).float()
        finite = bool(torch.isfinite(half).all())
        error = relative_error(half, exact) if finite else float("inf")
        rows.append({"model": name, "source": plan.models[0], "img_size": size, "rel_error": error,
                     "finite": finite})
    return rows


# -- 3. distill ---------------------------------------------------------------------------------------
def synthetic_images(root: Path, per_class: int, classes: int = SYNTHETIC_CLASSES, size: int = 32) -> Path:
    """train/ and val/ of noise tinted by class: learnable, so the loss of a working run falls."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", max(2, per_class // 8))):
        for c in range(classes):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                tint = np.zeros(3, dtype=np.int16)
                tint[c % 3] = 150 if c < 3 else 0
                pixels = np.clip(rng.integers(0, 100, (size, size, 3)) + tint, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def student_folder(root: Path, softmax: torch.nn.Module) -> Path:
    """A converted student whose recorded teacher is ``softmax`` saved as a local folder (no download)."""
    teacher = root / "teacher"
    timm.models.save_for_hf(softmax, str(teacher), safe_serialization=True)
    source = load_source(str(teacher))
    student, _ = vitconvert.convert(source.model, "elu", source=str(teacher))
    return vitconvert.save(student, root / "student", pretrained=True)


def distill(plan: Plan, device: torch.device) -> dict[str, Any]:
    """2 epochs of ``distill_steps`` steps; SIGTERM a fifth into the second epoch, then --resume to the end."""
    from vitconvert.distill import DistillJob, TrainingStopped, run

    steps = plan.distill_steps
    stop_at = steps + max(1, steps // 5)
    if steps * plan.distill_batch % SYNTHETIC_CLASSES:
        raise ValueError(f"distill_steps × distill_batch must be a multiple of {SYNTHETIC_CLASSES}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        softmax = softmax_source(plan, plan.models[0], plan.distill_size, num_classes=SYNTHETIC_CLASSES)
        student = student_folder(root, softmax)
        data = synthetic_images(root / "data", per_class=steps * plan.distill_batch // SYNTHETIC_CLASSES)
        overrides = {"data": str(data), "epochs": 2, "batch_size": plan.distill_batch, "warmup_epochs": 0,
                     "lr": 5e-4, "log_interval": 1, "workers": plan.workers, "rand_augment": None,
                     "color_jitter": None, "reprob": 0.0, "mixup": 0.0, "cutmix": 0.0, "drop_path": 0.0,
                     "compare_batches": 0, "amp": True, "amp_dtype": "bfloat16"}
        recipe, text = load_recipe(None, overrides)

        def job(resume: bool) -> DistillJob:
            return DistillJob(str(student), recipe, root / "run", text, resume=resume, device=str(device),
                              compile=plan.distill_compile, show=False)

        def stop(trainer) -> None:
            if trainer.pos.step == stop_at:
                signal.raise_signal(signal.SIGTERM)

        started = time.perf_counter()
        stopped = ""
        try:
            run(job(resume=False), on_step=stop)
        except TrainingStopped as e:
            stopped = str(e).split(";")[0]
        result = run(job(resume=True))
        records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("kind") == "step"]
    speeds = [r["img_s"] for r in records if r.get("kind") == "step"][2:]  # past compilation
    window = max(1, len(losses) // 10)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    final_step = max((r["step"] for r in records if r.get("kind") == "step"), default=0)
    return {"steps": final_step, "expected_steps": 2 * steps, "stopped": stopped, "resumed": bool(stopped),
            "first_loss": first, "last_loss": last, "loss_falls": last < first, "compile": plan.distill_compile,
            "amp": "bfloat16", "channels_last": device.type == "cuda", "batch": plan.distill_batch,
            "img_size": plan.distill_size, "img_s": sorted(speeds)[len(speeds) // 2] if speeds else None,
            "top1": result.metrics.get("top1"), "seconds": time.perf_counter() - started,
            "ok": bool(stopped) and final_step == 2 * steps and last < first}


# -- 4. cost ------------------------------------------------------------------------------------------
def cost(speed: list[dict[str, Any]], plan: Plan, dry_run: bool = True) -> list[dict[str, Any]]:
    """GPU-hours of each recipe: epochs × images × (teacher forward + student training step) per image.

    Both per-image times come from the eager bf16 rows at the recipe's image size (the smallest measured size
    in a dry run); data loading, validation and the optimizer update are left out, so this is a lower bound.
    """
    rows = []
    eager = [r for r in speed if not r["compile"] and not r["fla"]]
    for name, images in DATASET_IMAGES.items():
        recipe, _ = load_recipe(name)
        size = recipe.img_size if recipe.img_size in plan.sizes else plan.sizes[0]
        for source in plan.models:
            at = {(r["model"], r["mode"]): r for r in eager if r["source"] == source and r["img_size"] == size}
            teacher = at.get((SOFTMAX, "infer"))
            for model in [SOFTMAX, *VARIANTS]:
                student = at.get((model, "train"))
                if teacher is None or student is None:
                    continue
                seconds = 1 / teacher["img_per_s"] + 1 / student["img_per_s"]
                rows.append({"recipe": name, "images": images, "epochs": recipe.epochs, "img_size": size,
                             "source": source, "model": model, "img_per_s": 1 / seconds,
                             "gpu_hours": recipe.epochs * images * seconds / 3600})
    softmax = {(r["recipe"], r["source"]): r["gpu_hours"] for r in rows if r["model"] == SOFTMAX}
    for r in rows:  # the target: converting costs no more GPU time than training the softmax student
        limit = softmax.get((r["recipe"], r["source"]))
        r["verdict"] = (NOT_MEASURED if r["model"] == SOFTMAX or limit is None else
                        "dry run" if dry_run else ("pass" if r["gpu_hours"] <= limit else "FAIL"))
    return rows


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


def run_section(label: str) -> str:
    """The section a speed run belongs to, from its label (speed_runs)."""
    kind = label.split()[0]
    return "speed" if kind == "eager" else kind


def print_tables(check: Check, console: Console) -> None:
    if check.parity:
        console.print(parity_table(check.parity))
    if check.op:
        console.print(op_table(check.op))
    console.print(speed_table(check))
    for p in check.precision:
        console.print(f"bf16 vs fp32 {p['source']} {p['img_size']}px {p['model']}: relative error "
                      f"{p['rel_error']:.2e}, {'finite' if p['finite'] else 'NaN/inf'}")
    if check.distill:
        d = check.distill
        console.print(f"distill: {d['steps']}/{d['expected_steps']} steps, loss {d['first_loss']:.4f} -> "
                      f"{d['last_loss']:.4f}, resumed after '{d['stopped']}': {'ok' if d['ok'] else 'FAILED'}")
    console.print(cost_table(check.cost))
    for line in check.skipped:
        console.print(f"skipped: {line}")
    for line in check.errors:
        console.print(f"[red]error[/]: {line}")


def target_text(target: Optional[float]) -> str:
    return f"≥{target}×" if target else NOT_MEASURED


def parity_table(rows: list[dict[str, Any]]) -> Table:
    def error(value: Optional[float]) -> str:
        return f"{value:.1e}" if value is not None else "-"

    table = Table(title="the fused kernels against the eager forms: a training step's output and gradients, "
                        "relative error (bf16: against the eager float32 step)")
    for column in ("model", "px", "fp32 out", "fp32 grad", "bf16 out", "bf16 grad", "eager bf16 out",
                   "eager bf16 grad", "launches", "verdict"):
        table.add_column(column, justify="left" if column in ("model", "verdict") else "right")
    for r in rows:
        table.add_row(r["model"], str(r["img_size"]), error(r["fp32_output_error"]), error(r["fp32_grad_error"]),
                      error(r["bf16_output_error"]), error(r["bf16_grad_error"]), error(r["eager_bf16_output_error"]),
                      error(r["eager_bf16_grad_error"]), f"{r['fp32_launches']}/{r['bf16_launches']}", r["verdict"])
    return table


def op_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="one attention layer, bf16 autocast: token mixing of (B, H, N, d) q, k, v vs SDPA")
    for column in ("N", "B×H×d", "mode", "model", "ms", "× SDPA", "TFLOP/s", "GB/s", "target", "verdict"):
        table.add_column(column, justify="left" if column in ("mode", "model", "verdict") else "right")
    for r in rows:
        table.add_row(str(r["tokens"]), f"{r['batch']}×{r['heads']}×{r['head_dim']}", r["mode"], r["model"],
                      f"{r['ms']:.3f}", f"{r['speedup']:.2f}" if r["speedup"] else "-", f"{r['tflops']:.1f}",
                      f"{r['gb_s']:.0f}", target_text(r["target"]), r["verdict"])
    return table


def speed_table(check: Check) -> Table:
    env = check.env
    title = f"gpu_check on {env['gpu']} ({env['device']}), torch {env['torch']}, CUDA {env['cuda']}, {env['date']}"
    table = Table(title=title + ("  [DRY RUN: not GPU numbers]" if check.dry_run else ""))
    for column in ("source", "px", "mode", "compile", "fla", "model", "batch", "img/s", "× softmax", "FLOP bound",
                   "peak MB", "target", "verdict", "memory"):
        table.add_column(column, justify="left" if column in ("source", "mode", "model", "verdict") else "right")
    for r in check.speed:
        table.add_row(r["source"], str(r["img_size"]), r["mode"], r["compile"] or "-", "on" if r["fla"] else "-",
                      r["model"], str(r["batch_size"]), f"{r['img_per_s']:.1f}", f"{r['speedup']:.2f}",
                      f"{r['flop_bound']:.2f}", f"{r['peak_mem_mb']:.0f}" if r["peak_mem_mb"] is not None else "-",
                      target_text(r["target"]), r["verdict"], r.get("memory_verdict", NOT_MEASURED))
    return table


def cost_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="GPU-hours of a recipe (teacher forward + student step, measured img/s; a lower bound)")
    for column in ("recipe", "epochs × images", "px", "source", "model", "img/s", "GPU-hours", "≤ softmax"):
        table.add_column(column)
    for c in rows:
        table.add_row(c["recipe"], f"{c['epochs']} × {c['images']:,}", str(c["img_size"]), c["source"], c["model"],
                      f"{c['img_per_s']:.1f}", f"{c['gpu_hours']:.1f}", c.get("verdict", NOT_MEASURED))
    return table


def with_sizes(plan: Plan, text: str) -> Plan:
    """``plan`` with the speed rows at the comma-separated image sizes of ``text`` (--sizes); a size the plan has no
    batch for starts with 224 px's tokens per batch (FULL: 256 images)."""
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(s <= 0 or s % 16 for s in sizes):
        raise ValueError(f"--sizes {text!r}: give image sizes that are multiples of 16, e.g. 224,1024")
    batch = {s: plan.batch.get(s) or max(1, int(FULL.batch[224] * (224 / s) ** 2)) for s in sizes}
    return replace(plan, sizes=sizes, batch=batch)


def main(argv: Optional[list[str]] = None) -> int:
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
        print(f"error: unknown section {unknown[0] if unknown else '(none)'!r}; valid: {', '.join(SECTIONS)}",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is available (a dry run: --device cpu --quick)", file=sys.stderr)
        return 2
    console = Console(width=None if sys.stdout.isatty() else 180)
    log = lambda text: console.log(text)  # noqa: E731
    results = Path(tempfile.gettempdir()) if args.quick else ROOT / "benchmarks" / "results"  # no dry run in the tree
    out = args.out or results / f"gpu-check-{device.type}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(check: Check) -> None:  # whole or not at all: a reader never sees half a file
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(asdict(check), indent=1))
        partial.replace(out)

    plan = QUICK if args.quick else FULL
    if args.sizes:
        try:
            plan = with_sizes(plan, args.sizes)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    check = run_check(plan, device, args.budget_s, log, save, sections)
    print_tables(check, console)
    console.print(f"wrote {out}")
    return 1 if check.errors else 0


if __name__ == "__main__":
    sys.exit(main())
