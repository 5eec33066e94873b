"""Host time of one attention layer: what Python and PyTorch spend around the kernels, against softmax's.

    python benchmarks/host_overhead.py                       # every variant, vit_small's layer, 16 + 1 tokens
    python benchmarks/host_overhead.py --variants elu,mhla --iters 500 --json host.json
    python benchmarks/host_overhead.py --variants elu,relu,inline --split   # the split kernels' launches

A GPU runs kernels while the host queues the next ones; when the host is slower (small batches, short
sequences, or a dozen small kernels per layer), the GPU waits and the layer's time is the host's. This measures
that floor: one layer of a tiny input (batch 1, a 4×4 grid and the class token), inference (no autograd) and a
training step (forward and backward), in bf16 autocast as users train, with the fused path on. Softmax is
timm's own Attention (PyTorch SDPA) in the same run; the ratio is variant time / softmax time (lower is better).
Also counted, per call (inference / training step): the Triton launches and the aten ops dispatched (each costs
host time of its own on a GPU: a few µs an aten op, more a Triton launch), the device-independent part.

On a GPU the kernels run (their work is a few µs at this size, so the time is the host's). Without one, the
Triton launches are replaced by a counter: the rest of the fused path (argument checks, the custom ops or their
autograd Functions, allocation, the float32 d×d steps) runs as on the GPU, and softmax's SDPA does its small
math on the CPU. The launches themselves (Triton's argument binding, ~10–20 µs each) are then not in the time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

if __name__ == "__main__" and not torch.cuda.is_available():  # the CPU's kernels: set before timm imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import timm  # noqa: E402

import vitconvert  # noqa: E402
from vitconvert.attention import VARIANTS  # noqa: E402
from vitconvert.attention.ops import dispatch  # noqa: E402
from vitconvert.attention.ops.linear import op as fused  # noqa: E402
from vitconvert.attention.ops.pairwise import op as fused_pairwise  # noqa: E402
from vitconvert.writer import write_text_atomic  # noqa: E402


class Launches:
    """Counts the Triton launches; ``run`` False leaves them out (no GPU: the kernels would run in the
    interpreter, whose time is not a GPU's)."""

    def __init__(self, run: bool) -> None:
        self.run, self.count = run, 0

    def __call__(self, kernel, grid, *args, **kwargs) -> None:
        self.count += 1
        if self.run:
            dispatch.build_and_run(kernel, grid, *args, **kwargs)


def layers(model_name: str, variants: list[str], device: torch.device,
           width: Optional[tuple[int, int]]) -> dict[str, torch.nn.Module]:
    """Softmax's first attention layer and each variant's, converted from it (a 64 px model: a 4×4 grid);
    ``width`` (embed dim, heads) replaces the model's."""
    torch.manual_seed(0)
    shape = {} if width is None else {"embed_dim": width[0], "num_heads": width[1]}
    source = timm.create_model(model_name, pretrained=False, img_size=64, depth=1, **shape)
    found = {"softmax": source.blocks[0].attn}
    for name in variants:
        student, _ = vitconvert.convert(source, name)
        found[name] = student.blocks[0].attn
    return {name: layer.to(device) for name, layer in found.items()}


class AtenOps(TorchDispatchMode):
    """Counts the aten ops a call dispatches (each costs host time on any device: a few µs on a GPU's host)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_ops() -> Iterator[AtenOps]:
    """An :class:`AtenOps` mode, the fused ops still called direct as without it (a dispatch mode would route
    them through the custom-op dispatcher, dispatch.direct), so their bodies' ops count too."""
    with dispatch.kernels_on(direct_under_modes=True), AtenOps() as mode:
        yield mode


def make_step(layer: torch.nn.Module, x: torch.Tensor, train: bool) -> Callable[[], None]:
    """A forward (``train``: and its backward, grad enabled) in bf16 autocast."""
    inputs = x.detach().clone().requires_grad_(train)

    def step() -> None:
        with torch.set_grad_enabled(train):
            with torch.autocast(inputs.device.type, dtype=torch.bfloat16):
                out = layer(inputs)
            if train:
                out.float().sum().backward()

    return step


def counts(step: Callable[[], None], launches: Launches) -> tuple[int, int]:
    """(Triton launches, aten ops) of one call."""
    launches.count = 0
    with counting_ops() as ops:
        step()
    return launches.count, ops.count


def timed(step: Callable[[], None], device: torch.device, iters: int) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters * 1e6


def time_in_turns(steps: dict[str, Callable[[], None]], device: torch.device, iters: int, repeats: int,
                  what: str) -> dict[str, float]:
    """Median µs per call of each step over ``repeats`` runs of ``iters`` calls, the steps timed in turns (the
    order reversed every other round), so that a loaded machine slows them alike. Progress on stderr."""
    for step in steps.values():
        for _ in range(max(3, iters // 10)):
            step()
    runs: dict[str, list[float]] = {key: [] for key in steps}
    for turn in range(repeats):
        print(f"timing {what}: round {turn + 1}/{repeats}", file=sys.stderr, flush=True)
        for key in (list(steps) if turn % 2 == 0 else list(reversed(steps))):
            runs[key].append(timed(steps[key], device, iters))
    return {key: statistics.median(times) for key, times in runs.items()}


def op_steps(device: torch.device) -> dict[str, Callable[[], None]]:
    """The token mixing alone on (1, 2, 17, 16) bf16 q, k, v, inference and training step: SDPA, and each fused
    op called direct (dispatch.direct) and through its custom op (as torch.compile and tracers call it)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 17, 16, generator=g).to(device, torch.bfloat16) for _ in range(3))
    mixing = torch.ones(1, 1, device=device)
    segments = torch.zeros(17, dtype=torch.int32, device=device)
    forms = {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        "linear_attention": lambda q, k, v: fused.attention(q, k, v, None, fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False),
        "blocked_attention": lambda q, k, v: fused.segmented_attention(q, k, v, None, None, mixing,
                                                                       fused.RELU_PLUS_EPS, 1e-6, 1e-6),
        "pairwise_attention": lambda q, k, v: fused_pairwise.pairwise(q, k, v, None, segments, mixing,
                                                                      fused.RELU_PLUS_EPS, 1e-6, 1e-6),
    }

    def step(form, train: bool, through_op: bool) -> Callable[[], None]:
        inputs = [t.clone().requires_grad_(train) for t in (q, k, v)]

        def run() -> None:  # (every form, SDPA's too, in a dispatch context: the same cost in each row)
            with dispatch.kernels_on(through_ops=through_op), torch.set_grad_enabled(train):
                out = form(*inputs)
                if train:
                    out.float().sum().backward()

        return run

    steps = {}
    for name, form in forms.items():
        for through_op in ((False,) if name == "sdpa" else (False, True)):
            label = name + (" (custom op)" if through_op else "")
            for mode in ("infer", "train"):
                steps[f"{label} {mode}"] = step(form, mode == "train", through_op)
    return steps


def report_ops(micros: dict[str, float]) -> list[dict]:
    print("\nthe token mixing alone, (1, 2, 17, 16) bf16 q, k, v: a fused op called direct or through its custom op")
    print(f"{'op':30} {'infer µs':>9} {'×sdpa':>7} {'train µs':>9} {'×sdpa':>7}")
    rows = []
    for label in dict.fromkeys(key.rsplit(" ", 1)[0] for key in micros):
        infer, train = micros[f"{label} infer"], micros[f"{label} train"]
        row = {"op": label, "infer_us": infer, "train_us": train, "infer_vs_sdpa": infer / micros["sdpa infer"],
               "train_vs_sdpa": train / micros["sdpa train"]}
        rows.append(row)
        print(f"{label:30} {infer:9.1f} {row['infer_vs_sdpa']:6.2f}× {train:9.1f} {row['train_vs_sdpa']:6.2f}×")
    return rows


def arguments(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224", help="timm name (random init, one block)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--iters", type=int, default=200, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (the median is reported)")
    parser.add_argument("--width", help="EMBED_DIM,HEADS instead of the model's (default on the CPU: 32,2, so "
                        "that the CPU's matmuls, which a GPU runs asynchronously, stay out of the time)")
    parser.add_argument("--split", action="store_true", help="heads split over token ranges, as when B·H is under "
                        "4 × the GPU's SMs (batch 16 at 197+ tokens on an H100): the split kernels' launches")
    parser.add_argument("--json", help="also write the rows here")
    return parser.parse_args(argv)


@contextmanager
def heads_split(split: bool) -> Iterator[None]:
    """Inside (``split``): every head's 17 tokens over 2 programs (16-token ranges), so the ELU/ReLU/InLine layers
    take the split kernels (state, read-out; and the read-out's and state's backward) instead of one launch each
    way."""
    if not split:
        yield
        return
    with dispatch.kernels_on(split_round=16, programs=1 << 20):
        yield


def argument_error(args: argparse.Namespace, variants: list[str]) -> Optional[str]:
    """What is wrong with the arguments that can be told before a model is built, or None."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants or args.iters < 1 or args.repeats < 1:
        return (f"--variants takes {', '.join(VARIANTS)} (got {args.variants!r}); --iters and --repeats "
                f"are at least 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        return f"--json {args.json}: its folder does not exist"
    return None


def measure(found: dict[str, torch.nn.Module], x: torch.Tensor, launches: Launches, device: torch.device,
            iters: int, repeats: int) -> tuple[dict[str, tuple[int, int]], dict[str, float], dict[str, float]]:
    """(launches and aten ops per call, µs per call) of each layer's inference and training step, and µs per call
    of the token mixing alone (op_steps), the Triton launches going through ``launches``."""
    with dispatch.launches_through(launches, device.type):
        steps = {f"{name} {mode}": make_step(layer, x, mode == "train") for name, layer in found.items()
                 for mode in ("infer", "train")}
        counted = {key: counts(step, launches) for key, step in steps.items()}
        for layer in found.values():
            layer.zero_grad(set_to_none=True)
        micros = time_in_turns(steps, device, iters, repeats, "the layers")
        op_micros = time_in_turns(op_steps(device), device, iters, repeats, "the token mixing alone")
    return counted, micros, op_micros


def report_layers(names: list[str], micros: dict[str, float], counted: dict[str, tuple[int, int]]) -> list[dict]:
    """One row per layer (softmax first), printed under the header main prints, each against softmax's."""
    rows = [{"layer": name, "infer_us": micros[f"{name} infer"], "train_us": micros[f"{name} train"],
             "launches_infer": counted[f"{name} infer"][0], "launches_train": counted[f"{name} train"][0],
             "aten_ops_infer": counted[f"{name} infer"][1], "aten_ops_train": counted[f"{name} train"][1]}
            for name in names]
    base = rows[0]
    for row in rows:
        row["infer_vs_softmax"] = row["infer_us"] / base["infer_us"]
        row["train_vs_softmax"] = row["train_us"] / base["train_us"]
        print(f"{row['layer']:8} {row['infer_us']:9.1f} {row['infer_vs_softmax']:8.2f}× {row['train_us']:9.1f} "
              f"{row['train_vs_softmax']:8.2f}× {row['launches_infer']:4d}/{row['launches_train']:<4d} "
              f"{row['aten_ops_infer']:4d}/{row['aten_ops_train']:<4d}")
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    args = arguments(argv)
    variants = [v for v in args.variants.split(",") if v]
    error = argument_error(args, variants)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the host's single thread of dispatch, as it queues a GPU's kernels
    launches = Launches(run=device.type == "cuda")
    width = args.width or (None if device.type == "cuda" else "32,2")
    try:
        found = layers(args.model, variants, device, None if width is None else tuple(map(int, width.split(","))))
    except ValueError:
        print(f"error: --width takes EMBED_DIM,HEADS (got {args.width!r})", file=sys.stderr)
        return 2
    x = torch.randn(1, 17, found["softmax"].qkv.in_features, device=device)
    kernels = "run" if launches.run else "replaced by a counter (no GPU)"
    layer_width = f"width {x.shape[-1]}, {found['softmax'].num_heads} heads"
    print(f"host time of one {args.model} attention layer ({layer_width}), batch 1, 17 tokens, bf16 autocast, "
          f"on {device.type}; " + ("heads split over 2 programs; " if args.split else "") +
          f"Triton launches {kernels}; median of {args.repeats} × {args.iters} calls, the layers in turns")
    print(f"{'layer':8} {'infer µs':>9} {'×softmax':>9} {'train µs':>9} {'×softmax':>9} {'launches':>9} "
          f"{'aten ops':>9}")
    with heads_split(args.split):
        counted, micros, op_micros = measure(found, x, launches, device, args.iters, args.repeats)
    rows = report_layers(list(found), micros, counted)
    op_rows = report_ops(op_micros)
    if args.json:
        meta = {"device": device.type, "torch": torch.__version__, "model": args.model, "width": layer_width,
                "kernels": kernels, "heads": "split" if args.split else "as the GPU's size chooses"}
        write_text_atomic(Path(args.json), json.dumps({"meta": meta, "rows": rows, "ops": op_rows}, indent=2))
    return 0

if __name__ == "__main__":
    sys.exit(main())
