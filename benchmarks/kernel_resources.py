"""Registers, spills and shared memory of each fused kernel as Triton builds it for the GPU at hand.

    python benchmarks/kernel_resources.py                          # head dims 64 and 128, bf16, default settings
    python benchmarks/kernel_resources.py --head-dims 32,64,96,128 --json resources.json
    VITCONVERT_FUSED_CONFIG=32,8 python benchmarks/kernel_resources.py   # another BLOCK_N, num_warps

Every fused op runs once, forward and backward, on small bf16 inputs (as autocast hands them over):
linear_attention for ELU (one program per head, and heads split over token ranges) and InLine,
blocked_attention for MHLA (RMSNorm in the op), and TTT's ttt_step. Each kernel it launches is listed with its
launch settings and, on a GPU, what the build used: registers per thread, registers spilled to local memory,
and shared memory. A kernel that spills runs far below the bandwidth its traffic allows: the first thing to
look at when a kernel is slower than its bytes say (TTT's backward holds a dozen d×d tiles). Without a GPU
(Triton's interpreter builds nothing) the kernels are listed without numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

if __name__ == "__main__" and not torch.cuda.is_available():  # the CPU's kernels: set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vitconvert.attention import dispatch, fused, fused_ttt  # noqa: E402
from vitconvert.attention.blocks import extended_block_mix, segment_index  # noqa: E402
from vitconvert.writer import write_text_atomic  # noqa: E402


class Builds:
    """Each distinct kernel build launched through it: name, settings, and the compiled kernel's resources."""

    def __init__(self, op: str = "") -> None:
        self.op = op
        self.rows: dict[tuple[Any, ...], dict[str, Any]] = {}

    def __call__(self, kernel, grid, *args, **kwargs) -> Any:
        compiled = dispatch.build_and_run(kernel, grid, *args, **kwargs)
        name = getattr(kernel, "fn", kernel).__name__
        settings = {key: kwargs[key] for key in ("BLOCK_N", "BLOCK_D", "num_warps") if key in kwargs}
        key = (self.op, name, *settings.values())
        if key not in self.rows:
            metadata = getattr(compiled, "metadata", None)
            self.rows[key] = {"op": self.op, "kernel": name, **settings, "grid": list(grid),
                              "registers": getattr(compiled, "n_regs", None),
                              "spills": getattr(compiled, "n_spills", None),
                              "shared_bytes": getattr(metadata, "shared", None)}
        return compiled


def op_calls(d: int, device: torch.device, side: int = 16) -> dict[str, Callable[[], torch.Tensor]]:
    """Each op on bf16 (2, 2, N, d) q, k, v with a key mask, N = 1 + side² (257: three token ranges per head when
    heads split): a forward whose output backward will take."""
    g = torch.Generator().manual_seed(0)
    tokens = 1 + side * side

    def qkv() -> list[torch.Tensor]:
        return [torch.randn(2, 2, tokens, d, generator=g).to(device, torch.bfloat16).requires_grad_()
                for _ in range(3)]

    mask = torch.ones(2, tokens, dtype=torch.bool, device=device)
    mask[-1, tokens // 2:] = False
    blocks = 4 if side % 4 == 0 else 1
    index = segment_index((side, side), (blocks, blocks), 1, device)
    mixing = extended_block_mix(torch.rand(blocks * blocks, blocks * blocks, generator=g)).to(device).requires_grad_()
    norms = [(1 + torch.rand(2 * d, generator=g)).to(device).requires_grad_() for _ in range(2)]
    weights = (0.1 * torch.randn(2, 3, d, d, generator=g)).to(device).requires_grad_()
    return {
        "linear_attention elu": lambda: fused.kernel_attention(*qkv(), mask, fused.ELU_PLUS_ONE, 1e-6),
        "linear_attention inline": lambda: fused.inline_attention(*qkv(), mask, d ** -0.5),
        "blocked_attention mhla": lambda: fused.segmented_attention(*qkv(), mask, index, mixing, fused.RELU_PLUS_EPS,
                                                                    1e-6, 1e-6, *norms, 1e-6, True),
        "ttt_step": lambda: fused_ttt.fused_step(*qkv(), mask, weights, d ** -0.5, 1.0),
    }


def measure(head_dims: list[int], device: torch.device, side: int = 16,
            ops: Optional[tuple[str, ...]] = None) -> list[dict[str, Any]]:
    """The builds of each op (all, or those named in ``ops``) at each head dim; "linear_attention elu split" is
    ELU with heads split over token ranges (the state and read-out kernels the other ops launch too)."""
    rows: list[dict[str, Any]] = []
    for d in head_dims:
        calls = op_calls(d, device, side)
        calls["linear_attention elu split"] = calls["linear_attention elu"]
        for op, call in calls.items():
            if ops is not None and op not in ops:
                continue
            wanted = dispatch._programs_wanted
            if op.endswith("split"):
                dispatch._programs_wanted = lambda device: 1 << 20
            print(f"building {op} at head dim {d}", file=sys.stderr, flush=True)  # (beside the table, not in it)
            builds = Builds(op)
            try:
                with dispatch.launches_through(builds, device.type):
                    call().float().square().mean().backward()
            finally:
                dispatch._programs_wanted = wanted
            rows += [{"head_dim": d, **row} for row in builds.rows.values()]
    return rows


def number(value: Optional[int]) -> str:
    return "—" if value is None else str(value)


def print_table(rows: list[dict[str, Any]], device: torch.device) -> None:
    built = device.type == "cuda"
    where = torch.cuda.get_device_name(device) if built else "no GPU: Triton's interpreter builds nothing"
    print(f"fused kernels as built on {where}; bf16 inputs; "
          f"{dispatch.CONFIG_ENV}={os.environ.get(dispatch.CONFIG_ENV, '(default)')}")
    print(f"{'d':>4}  {'op':26s} {'kernel':28s} {'BLOCK_N':>7} {'warps':>5} {'regs':>5} {'spills':>6} {'shared':>7}")
    for row in rows:
        print(f"{row['head_dim']:>4}  {row['op']:26s} {row['kernel']:28s} {row.get('BLOCK_N', 0):>7} "
              f"{row.get('num_warps', 0):>5} {number(row['registers']):>5} {number(row['spills']):>6} "
              f"{number(row['shared_bytes']):>7}")
    spilling = [r for r in rows if r["spills"]]
    if built:
        print(f"{len(spilling)} of {len(rows)} builds spill registers" + (
            ": " + ", ".join(sorted({f'{r["kernel"]} (d {r["head_dim"]})' for r in spilling})) if spilling else ""))


def parse_dims(text: str) -> list[int]:
    dims = [int(x) for x in text.split(",") if x.strip()]
    bad = [x for x in dims if not dispatch.MIN_HEAD_DIM <= x <= dispatch.MAX_HEAD_DIM]
    if not dims or bad:
        raise ValueError(f"head dims must be {dispatch.MIN_HEAD_DIM}..{dispatch.MAX_HEAD_DIM}, got {text!r}")
    return dims


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default=None, help="comma-separated (default 64,128 on a GPU, 32 without)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dims = parse_dims(args.head_dims or ("64,128" if device.type == "cuda" else "32"))
    except ValueError as e:
        print(f"error: --head-dims: {e}", file=sys.stderr)
        return 2
    if args.json is not None and not args.json.parent.is_dir():
        print(f"error: --json: no folder {args.json.parent}", file=sys.stderr)
        return 2
    if device.type != "cuda" and not dispatch.interpreting():
        print("error: no GPU, and TRITON_INTERPRET=1 was not set before triton was imported", file=sys.stderr)
        return 2
    rows = measure(dims, device)
    print_table(rows, device)
    if args.json is not None:
        write_text_atomic(args.json, json.dumps({"device": str(device), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
