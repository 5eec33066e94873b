"""PTX instructions per bf16 element moved, and barriers per tile, of each main loop of the ELU/ReLU/InLine kernels.

    python benchmarks/kernel_instructions.py                       # sm_90, head dim 64 (deit_small), 4097 tokens
    python benchmarks/kernel_instructions.py --json benchmarks/results/kernel-instructions.json \\
        --baseline benchmarks/results/kernel-instructions-before.json   # and each ratio to an earlier run

A proxy of speed without a GPU (issue 37, item 5). The kernels' main loops are bound by issue and latency, not
by memory (one H200 moved a fifth of its bandwidth through them): what a loop costs per tile of BLOCK_N tokens
is its instructions, and the cross-warp barriers its reductions take. Each kernel the linear_attention op launches
forward and backward (one program per head, and the split form: heads over token ranges) is built for ``--arch`` by
Triton's compiler, as ``kernel_resources.py --arch`` builds it (nothing launched, no GPU needed), on bf16 q, k, v
laid out as timm's qkv projection hands them over, without a key mask, on the default launch settings. In the
PTX, each top-level loop (a backward branch to a label) is one loop over token tiles; per thread and iteration:

    instructions   the PTX instructions of the loop's body
    elements       bf16 elements it moves to or from global memory: its ld/st.global and cp.async bytes / 2
    per element    instructions / elements
    bar.sync       barriers (cross-warp reductions and shared-memory hand-offs)

"forward"/"backward" sum instructions and elements over the main loops of each direction's kernels. A split kernel's
last program also loops over the token ranges' partial sums, once a head: listed as "partial sums", not summed.
PTX is what Triton emits, before ptxas: a proxy of the SASS that runs, not a timing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_resources, beside this script
from kernel_resources import CrossBuilds, cross_build_error  # noqa: E402

from vitconvert.attention.ops import dispatch  # noqa: E402
from vitconvert.attention.ops.linear import op as fused  # noqa: E402
from vitconvert.writer import write_text_atomic  # noqa: E402

VARIANTS = {"elu": fused.ELU_PLUS_ONE, "relu": fused.RELU, "inline": None}
PATHS = ("one launch", "split")
SUMS = "partial sums"  # a split kernel's last program summing the token ranges' partials: once a head, not a tile
TAIL = "partial chunk"  # a range's last chunk, short of BLOCK_N, with masks: a loop of one iteration at most
# the loops of each kernel, in the order they appear in its source (and its PTX)
LOOPS = {"attention_fwd_kernel": ("state", "read-out"),
         "attention_bwd_kernel": ("state", "read-out backward", "state backward"),
         "state_fwd_kernel": ("state",), "readout_fwd_kernel": ("read-out", TAIL),
         "readout_bwd_kernel": ("read-out backward",), "state_bwd_kernel": ("state backward", TAIL)}
BACKWARD = {"attention_bwd_kernel", "readout_bwd_kernel", "state_bwd_kernel"}

_LABEL = re.compile(r"^(\$\w+):$")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$\w+);")
_VECTOR = re.compile(r"\.v(\d)\b")
_WIDTH = re.compile(r"\.[bsuf](8|16|32|64)\b")
_COPY = re.compile(r"cp\.async\.c[ag]\.shared(?:::cta)?\.global(?:\.\w+)*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*"
                   r"(0x[0-9a-fA-F]+|\d+)")


class PtxBuilds(CrossBuilds):
    """:class:`CrossBuilds` that also keeps each kernel's PTX (kernel name -> text)."""

    def __init__(self, op: str, arch: str) -> None:
        super().__init__(op, arch)
        self.ptx: dict[str, str] = {}

    def compile(self, kernel, *args, **kwargs) -> Any:
        compiled = super().compile(kernel, *args, **kwargs)
        self.ptx[dispatch.kernel_name(kernel)] = compiled.asm["ptx"]
        return compiled


def instructions(lines: list[str]) -> list[str]:
    """The instruction statements among PTX lines: not labels, directives, declarations, braces or comments."""
    out = []
    for line in lines:
        text = line.split("//")[0].strip()
        if text.endswith(";") and not text.startswith((".", "{", "}")):
            out.append(text)
    return out


def global_bytes(statement: str) -> int:
    """Bytes one thread moves between global memory and registers/shared memory in this statement."""
    copy = _COPY.search(statement)
    if copy:
        return int(copy.group(1), 0)
    if not re.search(r"\b(ld|st)\.global\b", statement):
        return 0
    opcode = statement.split()[1 if statement.startswith("@") else 0]  # (after a predicate)
    vector, width = _VECTOR.search(opcode), _WIDTH.search(opcode)
    return (int(vector.group(1)) if vector else 1) * (int(width.group(1)) // 8 if width else 0)


def loops(ptx: str) -> list[dict[str, int]]:
    """Each top-level loop of a PTX kernel, in order: its instructions, global bytes and bar.sync per iteration."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line.split("//")[0].strip()))}
    spans = []
    for i, line in enumerate(lines):
        target = _BRANCH.search(line.split("//")[0])
        if target and labels.get(target.group(1), i) < i:
            spans.append((labels[target.group(1)], i))
    top = [s for s in spans if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in spans)]
    found = []
    for begin, end in sorted(set(top)):
        body = instructions(lines[begin:end + 1])
        moved = sum(global_bytes(s) for s in body)
        found.append({"instructions": len(body), "bytes": moved, "elements": moved / 2,
                      "bar_sync": sum(1 for s in body if re.search(r"\b(bar|barrier)\.sync\b", s))})
    return found


def op_call(variant: str, tokens: int, d: int, heads: int = 6, batch: int = 2):
    """A forward of ``variant``'s linear_attention on bf16 (B, H, N, d) views of one qkv projection (timm's
    layout), whose output backward takes."""
    qkv = torch.randn(batch, tokens, 3, heads, d, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, k, v = qkv.requires_grad_().permute(2, 0, 3, 1, 4).unbind(0)
    if variant == "inline":
        return fused.attention(q, k, v, None, fused.IDENTITY, 0.0, 0.0, d ** -0.5, True)
    return fused.attention(q, k, v, None, VARIANTS[variant], 0.0, 1e-6, 1.0, False)


def measure(arch: str = "sm_90", d: int = 64, tokens: int = 4097) -> list[dict[str, Any]]:
    """One row per (variant, path, kernel, loop): its per-iteration counts (:func:`loops`)."""
    rows = []
    for variant in VARIANTS:
        for path in PATHS:
            print(f"building {variant} ({path})", file=sys.stderr, flush=True)
            builds = PtxBuilds(f"linear_attention {variant}", arch)
            programs = 1 << 20 if path == "split" else None  # (as kernel_resources.py's "split" op)
            with dispatch.kernels_on("cpu", launcher=builds, programs=programs):
                op_call(variant, tokens, d).float().square().mean().backward()
            settings = {row["kernel"]: row for row in builds.rows.values()}
            for kernel, ptx in builds.ptx.items():
                found = loops(ptx)
                names = LOOPS.get(kernel, ())
                for i, loop in enumerate(found):  # (after the token loops: the last program's sums over partials)
                    rows.append({"variant": variant, "path": path, "kernel": kernel,
                                 "loop": names[i] if i < len(names) else SUMS,
                                 "main": i < len(names) and names[i] != TAIL,
                                 "direction": "backward" if kernel in BACKWARD else "forward",
                                 "BLOCK_N": settings[kernel]["BLOCK_N"], "num_warps": settings[kernel]["num_warps"],
                                 "registers": settings[kernel]["registers"], "spills": settings[kernel]["spills"],
                                 **loop,
                                 "per_element": round(loop["instructions"] / max(loop["elements"], 1), 3)})
    return rows


def totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """"variant path direction" -> instructions per element over its main loops (over token tiles), and bar.sync
    per tile (summed)."""
    out: dict[str, dict[str, float]] = {}
    for row in (r for r in rows if r["main"]):
        key = f"{row['variant']} {row['path']} {row['direction']}"
        total = out.setdefault(key, {"instructions": 0, "elements": 0.0, "bar_sync": 0})
        for field in ("instructions", "elements", "bar_sync"):
            total[field] += row[field]
    for total in out.values():
        total["per_element"] = round(total["instructions"] / max(total["elements"], 1), 3)
    return out


def print_table(rows: list[dict[str, Any]], sums: dict[str, dict[str, float]], arch: str, d: int, tokens: int,
                baseline: Optional[dict[str, Any]]) -> None:
    before = {(r["variant"], r["path"], r["kernel"], r["loop"]): r for r in (baseline or {}).get("rows", [])}
    print(f"Triton {dispatch.triton_version()}: ELU/ReLU/InLine main loops built for {arch}, head dim {d}, {tokens} "
          f"tokens, bf16; per thread and tile (loop iteration)" + ("; ×: against the baseline" if baseline else ""))
    print(f"{'variant':7s} {'path':10s} {'kernel':22s} {'loop':17s} {'BLOCK_N':>7} {'warps':>5} {'instr':>6} "
          f"{'elems':>6} {'instr/elem':>10} {'bar.sync':>8} {'regs':>5} {'spills':>6}"
          + ("  ×instr/elem" if baseline else ""))
    for r in rows:
        was = before.get((r["variant"], r["path"], r["kernel"], r["loop"]))
        ratio = f"  {r['per_element'] / was['per_element']:>11.2f}" if was and was["per_element"] else ""
        print(f"{r['variant']:7s} {r['path']:10s} {r['kernel']:22s} {r['loop']:17s} {r['BLOCK_N']:>7} "
              f"{r['num_warps']:>5} {r['instructions']:>6} {r['elements']:>6g} {r['per_element']:>10.2f} "
              f"{r['bar_sync']:>8} {r['registers']:>5} {r['spills']:>6}{ratio}")
    ratios = [r["per_element"] / before[key]["per_element"] for r in rows
              if (key := (r["variant"], r["path"], r["kernel"], r["loop"])) in before and r["main"]]
    if ratios:
        print(f"main loops against the baseline: {min(ratios):.2f}–{max(ratios):.2f}× instructions per element")
    print("summed over each direction's main loops:")
    for key, total in sums.items():
        was = (baseline or {}).get("totals", {}).get(key)
        ratio = f"  ({total['per_element'] / was['per_element']:.2f}× the baseline's {was['per_element']:.2f})" \
            if was else ""
        print(f"  {key:28s} {total['per_element']:6.2f} instructions per element, {total['bar_sync']:>3} bar.sync"
              + ratio)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", help="the GPU generation to build for (default sm_90: H100, H200)")
    parser.add_argument("--head-dim", type=int, default=64, help="default 64 (deit_small's)")
    parser.add_argument("--tokens", type=int, default=4097, help="default 4097 (1024 px)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and totals here")
    parser.add_argument("--baseline", type=Path, default=None, help="an earlier --json: print each ratio to it")
    args = parser.parse_args(argv)
    problem = cross_build_error(args.arch)
    if problem is None and not dispatch.MIN_HEAD_DIM <= args.head_dim <= dispatch.MAX_HEAD_DIM:
        problem = f"--head-dim: {dispatch.MIN_HEAD_DIM}..{dispatch.MAX_HEAD_DIM}, got {args.head_dim}"
    if problem is None and args.tokens < 1:
        problem = f"--tokens: at least 1, got {args.tokens}"
    if problem is None and args.json is not None and not args.json.parent.is_dir():
        problem = f"--json: no folder {args.json.parent}"
    baseline = None
    if problem is None and args.baseline is not None:
        try:
            baseline = json.loads(args.baseline.read_text())
        except (OSError, ValueError) as e:
            problem = f"--baseline: cannot read {args.baseline} ({type(e).__name__})"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    rows = measure(args.arch, args.head_dim, args.tokens)
    sums = totals(rows)
    print_table(rows, sums, args.arch, args.head_dim, args.tokens, baseline)
    if args.json is not None:
        write_text_atomic(args.json, json.dumps({"arch": args.arch, "head_dim": args.head_dim, "tokens": args.tokens,
                                                 "dtype": "bfloat16", "triton": dispatch.triton_version(),
                                                 "rows": rows, "totals": sums}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
