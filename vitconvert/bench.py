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

FLOPs come from ``torch.utils.flop_counter`` on one forward of each model: matmuls, linear layers,
convolutions and scaled-dot-product attention (4·N·d FLOPs per token and head for QKᵀ and AV) as dispatched,
so the softmax count is shared qkv/proj/MLP + 4·N²·C per layer and each variant's is shared + its own mixing.
Their ratio is the FLOP-bound speedup: what the variant would gain if every model ran at the same FLOP rate.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from .attention import VARIANTS
from .compare import require_matplotlib
from .convert import fresh_like
from .errors import BadValue, VitconvertError, first_line
from .export import export_onnx, require_onnx
from .folder import folder_block
from .loading import ANY_FORMS, refuse_file
from .selection import Spec, linear_layers
from .sources import load_source, resolve
from .surgery import find_softmax_attention, model_geometry, swap_attention
from .threads import torch_threads
from .timm_registry import create_source_model, source_architecture
from .writer import PNG_METADATA, atomic_file

SOFTMAX = "softmax"
MODES = ("infer", "train")


AUTO = "auto"  # the autocast dtype the device calls for (resolve_amp)


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

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "rows"}, "results": [asdict(r) for r in self.rows]}


# -- input validation --------------------------------------------------------------------------------
def parse_variants(text: Optional[str]) -> Optional[list[str]]:
    """'elu,relu' -> ['elu', 'relu']; None stays None (the default set)."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BadValue("to", f"needs at least one variant, e.g. {','.join(list(VARIANTS)[:2])}")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise VitconvertError(f"unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def parse_sizes(text: Optional[str]) -> Optional[list[int]]:
    """'224,512' -> [224, 512]; every entry a positive integer."""
    if text is None:
        return None
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) <= 0:
            raise BadValue("img_size", f"expects positive integers separated by commas, got {text!r}")
        sizes.append(int(part))
    return list(dict.fromkeys(sizes))


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
def make_step(model: nn.Module, x: torch.Tensor, mode: str, amp: Optional[str] = None) -> Callable[[], None]:
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


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(step: Callable[[], None], device: torch.device, clock: str = "wall") -> float:
    """Seconds of one step: wall-clock, or (``cpu``) this process's CPU time, which a machine shared with other
    work does not inflate; with one thread it is the compute time, with more it adds up every thread's."""
    now = CLOCKS[clock]
    synchronize(device)
    start = now()
    step()
    synchronize(device)
    return now() - start


def peak_memory_bytes(step: Callable[[], None], device: torch.device) -> int:
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


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# torch's counter knows the CUDA attention kernels; the CPU one needs the same formula (4·N·d per token, head).
EXTRA_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}


def flops_per_image(model: nn.Module, x: torch.Tensor) -> float:
    """FLOPs of one inference forward per image, as torch's FLOP counter sees the dispatched ops."""
    model.eval()
    with torch.inference_mode(), FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        model(x)
    return counter.get_total_flops() / x.shape[0]


def tokens_of(model: nn.Module) -> Optional[int]:
    num_prefix, grid = model_geometry(model)
    return num_prefix + grid[0] * grid[1] if grid is not None else None


def benchmark(
    source: Union[str, nn.Module],
    variants: Optional[Sequence[str]] = None,
    img_sizes: Optional[Sequence[int]] = None,
    batch_size: int = 1,
    train: bool = False,
    repeats: int = 5,
    warmup: int = 1,
    pretrained: bool = True,
    device: Optional[str] = None,
    threads: Optional[int] = None,
    options: Optional[dict[str, Any]] = None,
    log: Optional[Callable[[str], None]] = None,
    memory: bool = True,
    clock: str = "wall",
    amp: Optional[str] = AUTO,
    compile: Optional[str] = None,
    backend: str = "torch",
    keep_softmax: Spec = None,
) -> BenchReport:
    """Time the softmax source and each variant at each image size, taking turns; see the module doc.

    ``amp`` runs every forward under autocast of that dtype (``"auto"``: bfloat16 on CUDA, as ViTs are trained
    and served there, and none on the CPU; None or ``"none"``: the model's own float32); ``compile`` names a
    torch.compile backend ("inductor"), applied to every model after its FLOPs are counted (the first timed
    rounds include no compilation: warm-up compiles). ``backend="onnxruntime"`` times each model exported to ONNX (the
    dynamo exporter, as ``vitconvert export`` writes it) in an ONNX Runtime CPU session instead."""
    if backend not in BACKENDS:
        raise VitconvertError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    amp = resolve_amp(amp, device, backend)
    if backend == "onnxruntime" and (train or amp or compile or (device or "cpu").split(":")[0] != "cpu"):
        raise VitconvertError("the onnxruntime backend times inference on the CPU only (no training, autocast or "
                              "compile)")
    for name, value, least in (("batch_size", batch_size, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if value < least:
            raise BadValue(name, f"must be at least {least} (got {value})")
    if clock not in CLOCKS:
        raise VitconvertError(f"unknown clock {clock!r}; valid: {', '.join(CLOCKS)}")
    if device is not None and device.split(":")[0] not in ("cpu", "cuda"):
        raise VitconvertError(f"unknown device {device!r}; valid: cpu, cuda")
    if amp is not None and not isinstance(getattr(torch, amp, None), torch.dtype):
        raise VitconvertError(f"unknown autocast dtype {amp!r}; e.g. bfloat16, float16")
    with torch_threads(threads), compile_cache(compile):
        report = _benchmark(source, variants, img_sizes, batch_size, train, repeats, warmup, pretrained, device,
                            options, log, memory, clock, amp, compile, backend, keep_softmax)
    return replace(report, amp=amp, compile=compile, backend=backend)


def resolve_amp(amp: Optional[str], device: Optional[str], backend: str = "torch") -> Optional[str]:
    """The autocast dtype a run uses: ``"auto"`` is bfloat16 on a CUDA device (given, or the default one) with
    the torch backend, and none elsewhere; ``"none"`` and ``"float32"`` are none."""
    if amp == AUTO:
        on_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0] == "cuda"
        return "bfloat16" if on_cuda and backend == "torch" else None
    return None if amp in (None, "none", "float32") else amp


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


def _benchmark(source: Union[str, nn.Module], variants: Optional[Sequence[str]], img_sizes: Optional[Sequence[int]],
               batch_size: int, train: bool, repeats: int, warmup: int, pretrained: bool, device: Optional[str],
               options: Optional[dict[str, Any]], log: Optional[Callable[[str], None]], memory: bool,
               clock: str, amp: Optional[str], compile: Optional[str], backend: str = "torch",
               keep_softmax: Spec = None) -> BenchReport:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BadValue("device", f"{device}: no CUDA GPU is available")
    ref = reference_for(source, pretrained)
    names = list(variants) if variants else ref.variants
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise VitconvertError(f"unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}")
    rows: list[BenchRow] = []
    kept: list[int] = []  # the layers hybrids keep softmax (the same at every size)
    for size in img_sizes or [ref.default_size]:
        try:
            softmax = ref.build(size)
        except (RuntimeError, ValueError, AssertionError, TypeError) as e:  # sizes timm cannot take
            raise VitconvertError(f"cannot build {ref.arch} at {size} px: {first_line(e)}") from None
        depth = len(find_softmax_attention(softmax))
        if keep_softmax is None:
            keep_softmax = ref.keep_softmax  # a hybrid folder: timed with its own softmax layers
        kept = [i for i in range(depth) if i not in linear_layers(depth, keep_softmax=keep_softmax)]
        if len(kept) == depth:
            raise BadValue("keep_softmax", f"keeps all {depth} layers softmax: every 'variant' would be the softmax "
                                           "model itself; keep fewer")
        models = {SOFTMAX: softmax}
        for name in names:
            models[name] = linear_copy(softmax, name, {**ref.options.get(name, {}), **(options or {})},
                                       keep_softmax)
        models = {k: m.to(dev) for k, m in models.items()}
        x = torch.randn(batch_size, 3, size, size, generator=torch.Generator().manual_seed(0)).to(dev)
        tokens = tokens_of(softmax)
        flops = {k: flops_per_image(m, x) for k, m in models.items()}  # also the first inference warm-up
        if compile:
            models = {k: torch.compile(m, backend=compile) for k, m in models.items()}
        sessions = onnx_steps(models, x) if backend == "onnxruntime" else None
        for mode in MODES if train else MODES[:1]:
            if log:
                log(f"{size} px ({tokens} tokens), {mode}: {', '.join(models)}")
            rounds = warmup if sessions else warmup_rounds(warmup, mode, amp, compile)
            rows += _measure(models, x, mode, dev, repeats, rounds, size, tokens, flops, memory and not sessions,
                             clock, amp, sessions)
        del models, softmax
    return BenchReport(str(source) if not isinstance(source, nn.Module) else ref.arch, ref.arch, str(dev),
                       torch.get_num_threads(), batch_size, repeats, rows, clock, keep_softmax=kept or None)


BACKENDS = ("torch", "onnxruntime")


def onnx_steps(models: dict[str, nn.Module], x: torch.Tensor) -> dict[str, Callable[[], None]]:
    """One ONNX Runtime inference per model, each exported as ``vitconvert export`` does, on torch's thread count."""
    require_onnx()  # one line naming the extra, before the import would fail
    import onnxruntime as ort

    steps: dict[str, Callable[[], None]] = {}
    feed = x.cpu().numpy()
    with tempfile.TemporaryDirectory() as folder:
        for name, model in models.items():
            path = Path(folder) / f"{name}.onnx"
            export_onnx(model.eval(), x.cpu(), path)
            options = ort.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            steps[name] = partial(session.run, None, {session.get_inputs()[0].name: feed})
    return steps


def warmup_rounds(warmup: int, mode: str, amp: Optional[str], compile: Optional[str]) -> int:
    """FLOP counting already ran one plain inference forward; a compiled model needs one round to compile."""
    if compile:
        return max(warmup, 1)
    return max(warmup - 1, 0) if mode == "infer" and amp is None else warmup


def _measure(models: dict[str, nn.Module], x: torch.Tensor, mode: str, dev: torch.device, repeats: int,
             warmup: int, size: int, tokens: Optional[int], flops: dict[str, float], memory: bool,
             clock: str, amp: Optional[str] = None,
             steps: Optional[dict[str, Callable[[], None]]] = None) -> list[BenchRow]:
    steps = steps or {k: make_step(m, x, mode, amp) for k, m in models.items()}
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(repeats):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))  # no model always runs right after another
        for k in order:
            times[k].append(timed(steps[k], dev, clock))
    peaks = {k: peak_memory_bytes(step, dev) / 2**20 if memory else None for k, step in steps.items()}
    batch = x.shape[0]
    def per_image_ms(k: str) -> float:  # never 0, even for a tiny model on a coarse clock
        return max(statistics.median(times[k]) * 1e3 / batch, 1e-6)

    base_ms = per_image_ms(SOFTMAX)
    rows = []
    for k in steps:
        ms = per_image_ms(k)
        rows.append(BenchRow(
            model=k, img_size=size, tokens=tokens, mode=mode, batch_size=batch, ms_per_img=ms,
            img_per_s=1e3 / ms, peak_mem_mb=peaks[k], gflops_per_img=flops[k] / 1e9,
            speedup=base_ms / ms, flop_bound=flops[SOFTMAX] / flops[k] if flops[k] else math.nan,
            times_ms=[t * 1e3 for t in times[k]]))
    return rows


# -- output -----------------------------------------------------------------------------------------
def plot_speedups(report: BenchReport, path: Union[str, Path], force: bool = False,
                  inputs: Iterable[Union[str, Path]] = ()) -> Path:
    """PNG of speedup over softmax against tokens (log scale): solid measured, dashed the FLOP bound; written
    by writer.atomic_file's rules (a new .png, or one vitconvert wrote with ``force``; never an input)."""
    require_matplotlib()
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, safe in servers and threads

    fig = Figure(figsize=(7, 4.5), constrained_layout=True)
    ax = fig.subplots()
    modes = sorted({r.mode for r in report.rows}, key=MODES.index)
    for i, name in enumerate(dict.fromkeys(r.model for r in report.rows if r.model != SOFTMAX)):
        colour = f"C{i}"
        for mode in modes:
            rows = sorted((r for r in report.rows if r.model == name and r.mode == mode and r.tokens),
                          key=lambda r: r.tokens)
            if not rows:
                continue
            style = "-" if mode == "infer" else ":"
            ax.plot([r.tokens for r in rows], [r.speedup for r in rows], style, marker="o", color=colour,
                    label=f"{name} ({mode})")
            if mode == modes[0]:
                ax.plot([r.tokens for r in rows], [r.flop_bound for r in rows], "--", color=colour, alpha=0.4,
                        label="FLOP bound" if i == 0 else None)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ticks = sorted({r.tokens for r in report.rows if r.tokens})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tokens")
    ax.set_ylabel("speedup over softmax (×)")
    ax.set_title(f"{report.arch} on {report.device} ({report.threads} threads, {report.clock} clock)", fontsize=10)
    ax.legend(loc="best", fontsize=8)
    with atomic_file(path, force=force, inputs=inputs, name="plot", suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120, metadata=PNG_METADATA)
    return Path(path).expanduser()
