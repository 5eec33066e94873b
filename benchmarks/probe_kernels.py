"""A five-minute probe of the attention kernels for the next GPU window (issue 37, item 6).

    python benchmarks/probe_kernels.py --out probe.jsonl           # one GPU: under 5 minutes, builds included
    python benchmarks/probe_kernels.py --device cpu --quick        # the dry run the test suite runs (eager rows)

Every row is appended to ``--out`` (JSON lines) and printed the moment it is measured, so a run killed at its
limit keeps everything before that point. Sections, in order:
  parity   before any timing, the kernels against the float32 forms (probe_parity.py): ELU's and ReLU's φ on bf16
           pairs (inline PTX that only a GPU runs) over every bf16 value, then ELU's, ReLU's and InLine's mixing on
           bf16 q, k, v, a head in one program and heads split, against float32 (output and gradients);
  ceiling  a 3-in/1-out elementwise op (addcmul, bf16) over 4 × 256 MiB: the bytes per second this GPU's memory
           gives a kernel that does nothing but stream, the yardstick of every ``frac`` below;
  layers   SDPA softmax (FlashAttention) and each variant's token mixing on bf16 q, k, v (B=16, H=6, d=64:
           deit_small's layer) at 197/1025/4097/16385 tokens, and at batch 256 × 197 tokens (the 224 px case),
           forward and forward+backward: ``host_ms`` (back-to-back calls between two events: the host's launch
           time shows when it is the bottleneck), ``gpu_ms`` (the same call captured once in a CUDA graph and
           replayed: the GPU's own time), ``host_us`` (Python's time to issue one call), the least bytes the op
           must move and the share of the ceiling that is;
  tiles    ELU at 4097 tokens under each BLOCK_N × num_warps, and two pipeline depths (``VITCONVERT_FUSED_CONFIG``
           = BLOCK_N,num_warps[,num_stages]): the launch settings' rows, which registers alone chose so far;
  top      torch.profiler over one forward+backward of each mixer at 4097 tokens: its eight most expensive
           kernels (device time on a GPU, CPU time on a CPU).
On a CPU the same code runs eager (no graphs, no kernels, wall clock): it checks the script, not the GPU.
A section or row not reached before ``--budget-s`` is recorded as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import environment, first_line, mixer_step, token_mixers  # noqa: E402
from probe_parity import parity  # noqa: E402

from vitconvert.attention.ops import (
    dispatch,  # noqa: E402
    settings,  # noqa: E402
)

SECTIONS = ("parity", "ceiling", "layers", "tiles", "top")
Step = Callable[[], None]


class Probe:
    """Where rows go (a JSON-lines file, flushed per row, and stdout) and how much time is left."""

    def __init__(self, out: Path, budget_s: float, device: torch.device):
        self.out, self.deadline, self.device = out, time.monotonic() + budget_s, device
        out.parent.mkdir(parents=True, exist_ok=True)
        self.fh = out.open("a")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def row(self, section: str, **fields: Any) -> dict[str, Any]:
        record = {"section": section, **fields}
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        print(" ".join(f"{k}={short(v)}" for k, v in record.items()), flush=True)
        return record


def short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# -- clocks ------------------------------------------------------------------------------------------------
def host_ms(step: Step, device: torch.device, repeats: int) -> tuple[float, float]:
    """(ms per call, µs of host time to issue one call): ``repeats`` calls back to back, timed by events on a
    GPU (launch-bound ops show the host's pace) and by the wall clock on a CPU."""
    for _ in range(2):
        step()
    synchronize(device)
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            step()
            times.append(time.perf_counter() - began)
        return statistics.median(times) * 1e3, statistics.median(times) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    for _ in range(repeats):
        step()
    issued = time.perf_counter() - began
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / repeats, issued / repeats * 1e6


def gpu_ms(step: Step, device: torch.device, repeats: int) -> Optional[float]:
    """The GPU's own ms per call: one call captured in a CUDA graph (after warm-up on a side stream, as capture
    requires), replayed ``repeats`` times between events. None on a CPU."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / repeats


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timings(step: Step, device: torch.device, repeats: int) -> dict[str, Any]:
    """Both clocks for one step; a graph that cannot be captured is recorded, not fatal."""
    ms, issue_us = host_ms(step, device, repeats)
    result: dict[str, Any] = {"host_ms": ms, "host_us": issue_us}
    try:
        result["gpu_ms"] = gpu_ms(step, device, repeats)
    except Exception as e:  # (a capture-unsafe op: the host rows still stand)
        result["gpu_ms"], result["graph_error"] = None, first_line(e)
    return result


# -- sections ----------------------------------------------------------------------------------------------
def ceiling(probe: Probe, plan: Plan) -> Optional[float]:
    """GB/s of addcmul (3 tensors in, 1 out) in bf16: the streaming rate the op rows are judged against."""
    n = plan.ceiling_elements
    a, b, c = (torch.randn(n, device=probe.device, dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(a)
    measured = timings(lambda: torch.addcmul(a, b, c, out=out), probe.device, plan.repeats)
    ms = measured["gpu_ms"] or measured["host_ms"]
    gb_s = 4 * n * 2 / ms / 1e6
    probe.row("ceiling", op="addcmul bf16", elements=n, gb_s=gb_s, **measured)
    return gb_s


def least_bytes(elements: int, mode: str) -> int:
    """q, k, v read and o written (forward); backward also reads o and dO and writes dq, dk, dv (bf16)."""
    return elements * 2 * (4 if mode == "infer" else 12)


def layers(probe: Probe, plan: Plan, ceiling_gb_s: Optional[float]) -> None:
    heads, d = plan.heads, plan.head_dim
    for batch, tokens in plan.shapes:
        tensors = qkv(batch, heads, tokens, d, probe.device)
        for name, mix in token_mixers(tokens, heads, d, probe.device).items():
            for mode in ("infer", "train"):
                where = dict(batch=batch, tokens=tokens, heads=heads, head_dim=d, model=name, mode=mode)
                if probe.left() <= 0:
                    probe.row("layers", **where, skipped="budget")
                    continue
                probe.row("layers", **where, **measure(probe, plan, mix, mode, tensors, ceiling_gb_s))
        del tensors


def measure(probe: Probe, plan: Plan, mix: Callable[..., Any], mode: str, tensors: tuple[torch.Tensor, ...],
            ceiling_gb_s: Optional[float]) -> dict[str, Any]:
    """Both clocks and the byte rates of one mixer in one mode on (q, k, v, dO)."""
    measured = guarded(lambda: timings(mixer_step(mix, mode, *tensors), probe.device, plan.repeats), probe.device)
    return {**measured, **rates(measured, least_bytes(tensors[0].numel(), mode), ceiling_gb_s)}


def rates(measured: dict[str, Any], moved: int, ceiling_gb_s: Optional[float]) -> dict[str, Any]:
    ms = measured.get("gpu_ms") or measured.get("host_ms")
    if not ms:
        return {}
    gb_s = moved / ms / 1e6
    return {"bytes": moved, "gb_s": gb_s, "frac": gb_s / ceiling_gb_s if ceiling_gb_s else None}


def guarded(work: Callable[[], dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """A row's measurement, or what stopped it (out of memory, a kernel that does not build) as its error."""
    try:
        return work()
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": "out of memory"}
    except Exception as e:
        return {"error": first_line(e)}


def qkv(batch: int, heads: int, tokens: int, d: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(0)
    return tuple(torch.randn(batch, heads, tokens, d, generator=g).to(device, torch.bfloat16) for _ in range(4))


def launch_setting(value: str) -> Any:
    """The launches inside on ``VITCONVERT_FUSED_CONFIG=value``'s settings (injected: a launch never reads the
    environment)."""
    chosen = dataclasses.replace(dispatch.launch_settings(), config=settings.config_setting(value))
    return dispatch.kernels_on(settings=chosen)


def tiles(probe: Probe, plan: Plan, ceiling_gb_s: Optional[float]) -> None:
    """ELU's mixing at one token count under every launch setting of the sweep."""
    batch, tokens = plan.batch, plan.tile_tokens
    tensors = qkv(batch, plan.heads, tokens, plan.head_dim, probe.device)
    for setting in plan.tile_settings:
        for mode in ("infer", "train"):
            where = dict(batch=batch, tokens=tokens, model="elu", config=setting, mode=mode)
            if probe.left() <= 0:
                probe.row("tiles", **where, skipped="budget")
                continue
            with launch_setting(setting):
                mix = token_mixers(tokens, plan.heads, plan.head_dim, probe.device)["elu"]
                measured = measure(probe, plan, mix, mode, tensors, ceiling_gb_s)
            probe.row("tiles", **where, **measured)


def top_kernels(probe: Probe, plan: Plan) -> None:
    """The most expensive kernels of one forward+backward of each mixer (after a warm-up step)."""
    from torch.profiler import ProfilerActivity, profile

    batch, tokens = plan.batch, plan.tile_tokens
    tensors = qkv(batch, plan.heads, tokens, plan.head_dim, probe.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if probe.device.type == "cuda" else [])
    for name, mix in token_mixers(tokens, plan.heads, plan.head_dim, probe.device).items():
        if probe.left() <= 0:
            probe.row("top", model=name, tokens=tokens, skipped="budget")
            continue
        try:
            step = mixer_step(mix, "train", *tensors)
            step()
            synchronize(probe.device)
            with profile(activities=activities) as prof:
                step()
                synchronize(probe.device)
        except Exception as e:
            probe.row("top", model=name, tokens=tokens, error=first_line(e))
            continue
        probe.row("top", model=name, tokens=tokens, kernels=most_expensive(prof, probe.device, plan.top))


def most_expensive(prof: Any, device: torch.device, count: int) -> list[dict[str, Any]]:
    """[{name, calls, us}] by device time on a GPU (kernels only), by self CPU time on a CPU."""
    rows = []
    for event in prof.key_averages():
        if device.type == "cuda":
            us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        else:
            us = event.self_cpu_time_total
        if us > 0:
            rows.append({"name": event.key[:120], "calls": event.count, "us": float(us)})
    return sorted(rows, key=lambda r: -r["us"])[:count]


# -- plan and main -----------------------------------------------------------------------------------------
class Plan:
    """What one run measures: FULL fits under five minutes of one H100/H200, QUICK seconds of a CPU."""

    def __init__(self, batch: int, heads: int, head_dim: int, tokens: tuple[int, ...], big: tuple[int, int],
                 tile_tokens: int, tile_settings: tuple[str, ...], ceiling_elements: int, repeats: int, top: int):
        self.batch, self.heads, self.head_dim, self.tile_tokens = batch, heads, head_dim, tile_tokens
        self.shapes = [*((batch, n) for n in tokens), big]
        self.tile_settings, self.ceiling_elements, self.repeats, self.top = tile_settings, ceiling_elements, \
            repeats, top


# BLOCK_N × num_warps at Triton's default stages, then the pipeline depth at one of them
SETTINGS = (*(f"{n},{w}" for n in settings.CONFIG_BLOCK_NS for w in (4, 8)), "64,4,2", "64,4,4")
FULL = Plan(16, 6, 64, (197, 1025, 4097, 16385), (256, 197), 4097, SETTINGS, 128 * 2**20, 20, 8)
QUICK = Plan(2, 2, 16, (17, 65), (4, 17), 65, ("16,4", "32,8"), 2**16, 2, 5)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the probe) or cpu (eager rows: a dry run)")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the dry run of the test suite")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/probe-kernels.jsonl"),
                        help="JSON lines, appended row by row")
    parser.add_argument("--budget-s", type=float, default=240.0, help="rows not started by then are skipped")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"a subset of {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --device cpu --quick for the dry run")
    device = torch.device(args.device)
    plan = QUICK if args.quick else FULL
    probe = Probe(args.out, args.budget_s, device)
    probe.row("environment", **environment(device), plan="quick" if args.quick else "full")
    if "parity" in sections:
        parity(probe, plan)
    rate = ceiling(probe, plan) if "ceiling" in sections else None
    for name, work in (("layers", lambda: layers(probe, plan, rate)), ("tiles", lambda: tiles(probe, plan, rate)),
                       ("top", lambda: top_kernels(probe, plan))):
        if name in sections:
            work()
    probe.row("done", seconds_left=probe.left())
    return 0


if __name__ == "__main__":
    sys.exit(main())
