"""Throughput and memory of linear-attention variants against their softmax source, measured side by side.

Everything runs in one process and the models take turns (softmax, variant 1, variant 2, …, then the reverse
order), so a machine shared with other work slows them alike and the speedups stay comparable even when the
absolute times drift. Times are medians over ``repeats`` rounds; speedup = softmax ms / variant ms. On a
heavily shared CPU, ``clock="cpu"`` with one thread times the process's CPU time instead of the wall clock.

Memory is the peak of tensor memory allocated during one step above what was allocated before it (weights,
input): ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the running total that PyTorch's CPU allocator
reports to the profiler (``profile_memory=True``). The process's peak RSS would also count glibc's cached
pages and cannot be reset between models that alternate in one process; a fresh process per measurement
would be exact but costs a model build each. The allocator total is exact for tensors, needs no new
process, and is what the CUDA number means too.

FLOPs (``flops.py``) are counted on one forward of each model; softmax FLOPs / a variant's is its FLOP-bound
speedup. Whether the times can be trusted (other work on the CPUs, rounds that disagree) is ``contention.py``'s
answer, kept in the report. What a run measures is a ``BenchConfig`` (``bench_config.py``); ONNX Runtime steps come from
``onnx_timing.py``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn import functional as F

from .attention import VARIANTS
from .bench_config import CLOCKS, BenchConfig
from .contention import Contention, speedup_spread, watched
from .conversion import fresh_like
from .errors import BadValue, VitconvertError, first_line
from .flops import flops_per_image
from .folder import folder_block
from .loading import ANY_FORMS, refuse_file
from .onnx_timing import onnx_steps
from .selection import Spec, linear_layers
from .sources import load_source, resolve
from .surgery import find_softmax_attention, model_geometry, swap_attention
from .threads import torch_threads
from .timm_registry import create_source_model, source_architecture

SOFTMAX = "softmax"
MODES = ("infer", "train")
Step = Callable[[], None]


@dataclass
class BenchRow:
    """One model at one image size in one mode."""

    model: str  # "softmax" or a variant name
    img_size: int
    tokens: Optional[int]
    mode: str  # "infer" or "train" (forward + backward of a cross-entropy loss)
    batch_size: int
    ms_per_img: float
    img_per_s: float
    peak_mem_mb: Optional[float]  # None when memory was not measured
    gflops_per_img: float
    speedup: float  # softmax ms / this model's ms at the same size and mode
    flop_bound: float  # softmax FLOPs / this model's FLOPs
    times_ms: list[float] = field(default_factory=list)  # per-round step times, for the record


@dataclass
class BenchReport:
    source: str
    arch: str
    device: str
    threads: int
    batch_size: int
    repeats: int
    rows: list[BenchRow]
    clock: str = "wall"
    amp: Optional[str] = None  # autocast dtype of the forward ("bfloat16"), None for the model's own dtype
    compile: Optional[str] = None  # torch.compile backend, None when not compiled
    backend: str = "torch"  # or "onnxruntime": every model exported to ONNX and run in an ORT CPU session
    keep_softmax: Optional[list[int]] = None  # the layers every variant keeps softmax (hybrids), None: none
    contention: Optional[dict[str, Any]] = None  # contention.Contention.to_dict(): may the times be trusted

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "rows"}, "results": [asdict(r) for r in self.rows]}


# -- building the models -----------------------------------------------------------------------------
@dataclass
class Reference:
    """How to build the softmax model at any image size, and which variants compare by default."""

    build: Callable[[Optional[int]], nn.Module]
    arch: str
    default_size: int
    variants: list[str]
    options: dict[str, dict[str, Any]]
    keep_softmax: Optional[list[int]] = None  # a hybrid folder's softmax layers: its variant is timed as it is


def own_img_size(model: nn.Module) -> int:
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if size is not None:
        return int(size[0])
    return int(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224))[-1])


def reference_for(source: Union[str, nn.Module], pretrained: bool = True) -> Reference:
    """The softmax model behind SOURCE: a timm name/folder/file, a vitconvert folder (its recorded source
    architecture, random weights: weights do not change speed), or a model object built by timm."""
    if isinstance(source, nn.Module):
        return _reference_from_module(source)
    resolved = resolve(source)
    if resolved.kind == "file":
        refuse_file(resolved, ANY_FORMS)
    if resolved.linear:
        config = resolved.config()
        block = folder_block(config) or {}

        def build_folder(size: Optional[int]) -> nn.Module:
            kwargs = {"img_size": size} if size else {}
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return create_source_model(config, **kwargs)

        model = build_folder(None)
        variant = block.get("variant")
        depth, linear = len(find_softmax_attention(model)), block.get("layers")
        kept = [i for i in range(depth) if i not in linear] if isinstance(linear, list) else []
        return Reference(build_folder, source_architecture(config)[0], own_img_size(model),
                         [variant] if variant in VARIANTS else list(VARIANTS),
                         {variant: dict(block.get("options") or {})} if variant else {}, kept or None)
    src = load_source(resolved, pretrained=pretrained)
    default = own_img_size(src.model)

    def build(size: Optional[int]) -> nn.Module:
        if not size or size == default:
            return src.model
        return load_source(resolved, pretrained=pretrained, img_size=size).model

    return Reference(build, src.arch, default, list(VARIANTS), {})


def _reference_from_module(model: nn.Module, arch: Optional[str] = None) -> Reference:
    default = own_img_size(model)

    def build(size: Optional[int]) -> nn.Module:
        if not size or size == default:
            return model
        return fresh_like(model, seed=0, img_size=size)

    arch = arch or getattr(model, "pretrained_cfg", {}).get("architecture", type(model).__name__)
    return Reference(build, arch, default, list(VARIANTS), {})


def linear_copy(softmax: nn.Module, variant: str, options: Optional[dict[str, Any]] = None,
                keep_softmax: Spec = None) -> nn.Module:
    """The softmax model with ``variant`` attention (its weights copied: speed does not depend on them), in
    every layer but ``keep_softmax`` (a hybrid)."""
    layers = linear_layers(len(find_softmax_attention(softmax)), keep_softmax=keep_softmax)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, _ = swap_attention(softmax, variant, options, layers=layers)
    return model


# -- measuring --------------------------------------------------------------------------------------
def make_step(model: nn.Module, x: torch.Tensor, mode: str, amp: Optional[str] = None) -> Step:
    """One inference forward, or one training step (forward + backward; the optimizer update is the same
    for every model and left out); the forward under ``amp`` autocast (e.g. "bfloat16") when given."""
    def autocast() -> AbstractContextManager:
        return torch.autocast(x.device.type, dtype=getattr(torch, amp)) if amp else nullcontext()

    if mode == "infer":
        model.eval()

        def infer() -> None:
            with torch.inference_mode(), autocast():
                model(x)

        return infer
    model.train()
    target = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)

    def train() -> None:
        with autocast():
            out = model(x)
        F.cross_entropy(out.float().flatten(1), target).backward()
        for p in model.parameters():
            p.grad = None

    return train


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Step, device: torch.device, clock: str = "wall") -> float:
    """Seconds of one step: wall-clock, or (``cpu``) this process's CPU time, which a machine shared with other
    work does not inflate; with one thread it is the compute time, with more it adds up every thread's."""
    now = CLOCKS[clock]
    synchronize(device)
    start = now()
    step()
    synchronize(device)
    return now() - start


def peak_memory_bytes(step: Step, device: torch.device) -> int:
    """Peak tensor memory allocated during one step above what was allocated when it began (see module doc)."""
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0]
    return max([0, *totals])  # the total starts at 0 when profiling starts


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ side prints status lines there that no flag turns off)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peaks_mib(steps: dict[str, Step], device: torch.device) -> dict[str, Optional[float]]:
    """Each step's peak memory in MiB (``peak_memory_bytes``), one step after another."""
    return {k: peak_memory_bytes(step, device) / 2**20 for k, step in steps.items()}


def tokens_of(model: nn.Module) -> Optional[int]:
    num_prefix, grid = model_geometry(model)
    return num_prefix + grid[0] * grid[1] if grid is not None else None


# -- running ---------------------------------------------------------------------------------------
def benchmark(config: Union[BenchConfig, str, nn.Module], *args: Any, log: Optional[Callable[[str], None]] = None,
              **kwargs: Any) -> BenchReport:
    """Time the softmax source and each variant at each image size, taking turns; see the module doc.

    ``config`` says what and how (``BenchConfig``); ``benchmark(source, variants, img_sizes, batch_size=...)``
    is the same with the config's fields as arguments. ``log`` hears one line per size and mode."""
    if not isinstance(config, BenchConfig):
        config = BenchConfig(config, *args, **kwargs)
    elif args or kwargs:
        raise TypeError("benchmark(config) takes no other settings: they are the config's fields")
    with torch_threads(config.threads), compile_cache(config.compile):
        return _run(config, log)


@contextmanager
def compile_cache(backend: Optional[str]) -> Iterator[None]:
    """Room in dynamo's cache for every model and mode that take turns (its default, 8 graphs per code object,
    would make the later ones run eager without a word), and a clean cache afterwards."""
    if backend is None:
        yield
        return
    import torch._dynamo

    with torch._dynamo.config.patch(cache_size_limit=256, accumulated_cache_size_limit=4096):
        try:
            yield
        finally:
            torch._dynamo.reset()


def _run(config: BenchConfig, log: Optional[Callable[[str], None]]) -> BenchReport:
    device = config.torch_device()
    ref = reference_for(config.source, config.pretrained)
    names = list(config.variants) if config.variants else ref.variants
    keep_softmax = ref.keep_softmax if config.keep_softmax is None else config.keep_softmax  # a hybrid folder's own
    rows: list[BenchRow] = []
    kept: list[int] = []  # the layers hybrids keep softmax (the same at every size)
    seen = Contention(clock=config.clock)
    for size in config.img_sizes or [ref.default_size]:
        softmax = _build_at(ref, size)
        kept = _softmax_layers(softmax, keep_softmax)
        models = {SOFTMAX: softmax}
        for name in names:
            models[name] = linear_copy(softmax, name, {**ref.options.get(name, {}), **(config.options or {})},
                                       keep_softmax)
        rows += _time_at_size(config, models, size, device, log, seen)
        del models, softmax
    source = str(config.source) if not isinstance(config.source, nn.Module) else ref.arch
    return BenchReport(source, ref.arch, str(device), torch.get_num_threads(), config.batch_size, config.repeats, rows,
                       clock=config.clock, amp=config.autocast, compile=config.compile, backend=config.backend,
                       keep_softmax=kept or None, contention=seen.to_dict())


def _build_at(ref: Reference, size: int) -> nn.Module:
    try:
        return ref.build(size)
    except (RuntimeError, ValueError, AssertionError, TypeError) as e:  # sizes timm cannot take
        raise VitconvertError(f"cannot build {ref.arch} at {size} px: {first_line(e)}") from None


def _softmax_layers(softmax: nn.Module, keep_softmax: Spec) -> list[int]:
    """The layers a hybrid keeps softmax; refused when that is all of them (nothing would be linear)."""
    depth = len(find_softmax_attention(softmax))
    kept = [i for i in range(depth) if i not in linear_layers(depth, keep_softmax=keep_softmax)]
    if len(kept) == depth:
        raise BadValue("keep_softmax", f"keeps all {depth} layers softmax: every 'variant' would be the softmax "
                                       "model itself; keep fewer")
    return kept


def _time_at_size(config: BenchConfig, models: dict[str, nn.Module], size: int, device: torch.device,
                  log: Optional[Callable[[str], None]], seen: Contention) -> list[BenchRow]:
    """Every model at one image size, in each mode: FLOPs first (also the first inference warm-up), then turns."""
    models = {k: m.to(device) for k, m in models.items()}
    x = torch.randn(config.batch_size, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    tokens = tokens_of(models[SOFTMAX])
    flops = {k: flops_per_image(m, x) for k, m in models.items()}
    if config.compile:
        models = {k: torch.compile(m, backend=config.compile) for k, m in models.items()}
    sessions = onnx_steps(models, x) if config.backend == "onnxruntime" else None
    rows = []
    for mode in MODES if config.train else MODES[:1]:
        if log:
            log(f"{size} px ({tokens} tokens), {mode}: {', '.join(models)}")
        steps = sessions or {k: make_step(m, x, mode, config.autocast) for k, m in models.items()}
        rounds = config.warmup if sessions else warmup_rounds(config.warmup, mode, config.autocast, config.compile)
        with watched(seen):
            times = take_turns(steps, device, config.repeats, rounds, config.clock)
        for name in times:
            if name != SOFTMAX:
                seen.add_spread(name, speedup_spread(times[SOFTMAX], times[name]))
        peaks = peaks_mib(steps, device) if config.memory and not sessions else dict.fromkeys(steps)
        rows += rows_of(times, peaks, flops, mode=mode, img_size=size, tokens=tokens, batch=config.batch_size)
    return rows


def warmup_rounds(warmup: int, mode: str, amp: Optional[str], compile: Optional[str]) -> int:
    """FLOP counting already ran one plain inference forward; a compiled model needs one round to compile."""
    if compile:
        return max(warmup, 1)
    return max(warmup - 1, 0) if mode == "infer" and amp is None else warmup


def take_turns(steps: dict[str, Step], device: torch.device, repeats: int, warmup: int,
               clock: str = "wall") -> dict[str, list[float]]:
    """Seconds of each step in each of ``repeats`` rounds, after ``warmup`` untimed ones; the order reverses
    every round, so no model always runs right after the same other one."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(repeats):
        for k in list(steps) if r % 2 == 0 else list(reversed(steps)):
            times[k].append(timed(steps[k], device, clock))
    return times


def rows_of(times: dict[str, list[float]], peaks: dict[str, Optional[float]], flops: dict[str, float], *, mode: str,
            img_size: int, tokens: Optional[int], batch: int) -> list[BenchRow]:
    """One row per model: the median step time per image, and speedup and FLOP bound against the softmax row."""
    def per_image_ms(k: str) -> float:  # never 0, even for a tiny model on a coarse clock
        return max(statistics.median(times[k]) * 1e3 / batch, 1e-6)

    base_ms = per_image_ms(SOFTMAX)
    rows = []
    for k in times:
        ms = per_image_ms(k)
        rows.append(BenchRow(
            model=k, img_size=img_size, tokens=tokens, mode=mode, batch_size=batch, ms_per_img=ms,
            img_per_s=1e3 / ms, peak_mem_mb=peaks[k], gflops_per_img=flops[k] / 1e9,
            speedup=base_ms / ms, flop_bound=flops[SOFTMAX] / flops[k] if flops[k] else math.nan,
            times_ms=[t * 1e3 for t in times[k]]))
    return rows
