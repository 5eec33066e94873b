"""Registers, spills and shared memory of each fused kernel as Triton builds it for the GPU at hand.

    python benchmarks/kernel_resources.py                          # head dims 64 and 128, bf16, default settings
    python benchmarks/kernel_resources.py --dtype float32          # float32 inputs (training without autocast)
    python benchmarks/kernel_resources.py --head-dims 32,64,96,128 --json resources.json
    VITCONVERT_FUSED_CONFIG=32,8 python benchmarks/kernel_resources.py   # another BLOCK_N, num_warps

Every fused op runs once, forward and backward, on small bf16 inputs (as autocast hands them over; --dtype):
linear_attention for ELU (one program per head, and heads split over token ranges) and InLine,
blocked_attention and pairwise_attention for MHLA (RMSNorm in the op), and TTT's ttt_step. Each kernel it
launches is listed with its launch settings and, on a GPU, what the build used: registers per thread, registers
spilled to local memory, and shared memory. A kernel that spills runs far below the bandwidth its traffic
allows: the first thing to look at when a kernel is slower than its bytes say (TTT's backward holds a dozen d×d
tiles). Without a GPU (Triton's interpreter builds nothing) the kernels are listed without numbers.

    python benchmarks/kernel_resources.py --arch sm_90             # no GPU needed: built for an H100/H200

``--arch`` builds every kernel with Triton's own compiler and ptxas for that GPU generation, on any machine
(Triton's wheel ships ptxas and cuobjdump), and launches nothing: the same registers, spills and shared memory,
and whether each kernel fits the generation's shared memory per block. A build that does not fit is refused as
Triton's launcher refuses it on such a GPU, and dispatch goes on as it would there (dispatch.launch): the same
kernel on 16-bit tiles, then on smaller token chunks, and where nothing fits, the op's eager form. The summary
says which kernels run lean and which fit nothing. One that Triton's compiler rejects outright (the interpreter
runs what the compiler refuses) fails here with the compiler's message. The tests build the kernels this way
(tests/attention/test_kernel_resources.py).

    python benchmarks/kernel_resources.py --arch sm_89 --ops "linear_attention elu"   # an L40 / RTX 4090
    python benchmarks/kernel_resources.py --arch sm_90 --ops ttt_step --max-registers 128   # two blocks of 8 warps:
                                                                                           # what spills there
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

if __name__ == "__main__" and not torch.cuda.is_available() and "--arch" not in " ".join(sys.argv):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU's kernels: set before anything imports triton

from vitconvert.attention.blocks import extended_block_mix, segment_index, token_segments  # noqa: E402
from vitconvert.attention.ops import dispatch  # noqa: E402
from vitconvert.attention.ops.linear import op as fused  # noqa: E402
from vitconvert.attention.ops.pairwise import op as fused_pairwise  # noqa: E402
from vitconvert.attention.ops.ttt import op as fused_ttt  # noqa: E402
from vitconvert.writer import write_text_atomic  # noqa: E402


class Builds:
    """Each distinct kernel build launched through it: name, settings, and the compiled kernel's resources. A
    launch that does not fit the GPU is a row too (``fits`` false), and the error goes on to dispatch, which tries
    leaner settings (dispatch.launch) as it does for any launch."""

    def __init__(self, op: str = "") -> None:
        self.op = op
        self.rows: dict[tuple[Any, ...], dict[str, Any]] = {}

    def __call__(self, kernel, grid, *args, **kwargs) -> Any:
        try:
            compiled = dispatch.build_and_run(kernel, grid, *args, **kwargs)
        except dispatch.KernelUnavailable as e:
            refused = {"registers": None, "spills": None, "shared_bytes": None, "fits": False, "refused": str(e)[:300]}
            self.add(kernel, grid, kwargs, lambda: refused)
            raise
        metadata = getattr(compiled, "metadata", None)
        self.add(kernel, grid, kwargs, lambda: {"registers": getattr(compiled, "n_regs", None),
                                                "spills": getattr(compiled, "n_spills", None),
                                                "shared_bytes": getattr(metadata, "shared", None), "fits": True})
        return compiled

    def add(self, kernel, grid, kwargs: dict, resources: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The row of this build (kernel and launch settings), made unless it exists: its name, settings, grid and
        ``resources()``."""
        name = dispatch.kernel_name(kernel)
        settings = {key: kwargs[key] for key in ("BLOCK_N", "BLOCK_D", "num_warps") if key in kwargs}
        settings["tile"] = tile_name(kwargs)
        key = (self.op, name, *settings.values())
        if key not in self.rows:
            self.rows[key] = {"op": self.op, "kernel": name, **settings, "grid": list(grid), **resources()}
        return self.rows[key]


def tile_name(kwargs: dict) -> str:
    """The dots' operands: tf32 (float32 tiles as TF32), fp32, bf16 or fp16."""
    tile = str(kwargs.get("TILE", ""))
    return "tf32" if tile == "fp32" and kwargs.get("PRECISION") == "tf32" else tile


# (capability, shared bytes one block may use, shared bytes per SM, warps per SM): the CUDA C programming
# guide's table of compute capabilities (the opt-in maximum per block; 64K registers per SM on each)
ARCHES = {"sm_70": (70, 98304, 98304, 64), "sm_75": (75, 65536, 65536, 32),
          "sm_80": (80, 166912, 167936, 64), "sm_86": (86, 101376, 102400, 48), "sm_89": (89, 101376, 102400, 48),
          "sm_90": (90, 232448, 233472, 64), "sm_100": (100, 232448, 233472, 64), "sm_120": (120, 101376, 102400, 48)}


def blocks_per_sm(arch: str, registers: int, shared: int, warps: int) -> int:
    """How many of a kernel's blocks one SM holds at once (occupancy): the least of what its registers (allocated
    per warp in steps of 256), its shared memory (plus the 1 KB the driver reserves per block from sm_80 on) and
    the warp slots allow. Memory-bound kernels need several to hide memory latency."""
    capability, per_block, per_sm, max_warps = ARCHES[arch]
    if shared > per_block:
        return 0
    registers_per_warp = -(-registers * 32 // 256) * 256
    reserved = 1024 if capability >= 80 else 0
    return min(65536 // (registers_per_warp * warps), per_sm // (shared + reserved), max_warps // warps)


class CrossBuilds(Builds):
    """:class:`Builds` that compiles each kernel for ``arch`` (Triton's compiler and ptxas, no GPU) and launches
    nothing: the ops go on with uninitialised outputs, which is harmless here (only shapes and dtypes matter)."""

    def __init__(self, op: str, arch: str, max_registers: Optional[int] = None) -> None:
        from triton.backends.compiler import GPUTarget  # lazy: start-up time (only this mode compiles)
        from triton.compiler import make_backend  # lazy: start-up time

        super().__init__(op)
        self.arch, self.max_registers = arch, max_registers
        capability, self.max_shared = ARCHES[arch][:2]
        self.target = GPUTarget("cuda", capability, 32)
        self.backend = make_backend(self.target)

    def __call__(self, kernel, grid, *args, **kwargs) -> None:
        row = self.add(kernel, grid, kwargs, lambda: self.build(kernel, *args, **kwargs))
        if not row["fits"] and "error" not in row:  # as Triton's launcher refuses it on such a GPU
            raise dispatch.KernelUnavailable(f"{row['kernel']} needs {row['shared_bytes']} bytes of shared memory, "
                                             f"{self.arch} gives a block {self.max_shared}", resources=True)

    def compile(self, kernel, *args, **kwargs) -> Any:
        """The kernel compiled for ``arch`` as Triton's JIT would for this launch: the arguments specialised as for a
        launch (alignment, constants), then Triton's compiler and ptxas (its ``asm``: ptx, cubin)."""
        import triton  # lazy: start-up time (only this mode compiles)
        from triton.compiler import ASTSource  # lazy: start-up time
        from triton.runtime.jit import create_function_from_signature  # lazy: start-up time

        bind = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        bound, specialization, options = bind(*args, **kwargs)
        options, signature, constants, attrs = kernel._pack_args(self.backend, kwargs, bound, specialization, options)
        return triton.compile(ASTSource(kernel, signature, constants, attrs), target=self.target,
                              options=options.__dict__)

    def build(self, kernel, *args, **kwargs) -> dict[str, Any]:
        """Registers per thread, spilled registers, shared bytes, whether it fits and blocks per SM; or, where
        Triton's compiler refuses the kernel, its first line as ``error`` (:meth:`compile`); cuobjdump reads the
        cubin."""
        import triton  # lazy: start-up time
        from triton.runtime.errors import TritonError  # lazy: start-up time

        capped = {} if self.max_registers is None else {"maxnreg": self.max_registers}  # (ptxas spills above it)
        try:
            compiled = self.compile(kernel, *args, **kwargs, **capped)
        except TritonError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            return {"registers": None, "spills": None, "shared_bytes": None, "fits": False, "blocks_per_sm": 0,
                    "error": f"{type(e).__name__}: {lines[-1] if lines else ''}"[:200]}
        with tempfile.TemporaryDirectory() as folder:
            cubin = Path(folder) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(cubin)],
                                   capture_output=True, text=True, check=True).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        if found is None:
            raise RuntimeError(f"cuobjdump printed no resource usage for {kernel.fn.__name__}: {usage[:200]}")
        # the stack frame taken as spilled registers, bytes / 4: what Triton reports on a GPU (the driver's local
        # memory per thread / 4)
        registers, spills, shared = int(found.group(1)), int(found.group(2)) // 4, int(compiled.metadata.shared)
        return {"registers": registers, "spills": spills, "shared_bytes": shared, "fits": shared <= self.max_shared,
                "blocks_per_sm": blocks_per_sm(self.arch, registers, shared, kwargs["num_warps"])}


def op_calls(d: int, device: torch.device, side: int = 16,
             dtype: torch.dtype = torch.bfloat16) -> dict[str, Callable[[], torch.Tensor]]:
    """Each op on ``dtype`` (2, 2, N, d) q, k, v with a key mask, N = 1 + side² (257: three token ranges per head when
    heads split): a forward whose output backward will take."""
    g = torch.Generator().manual_seed(0)
    tokens = 1 + side * side

    def qkv() -> list[torch.Tensor]:
        return [torch.randn(2, 2, tokens, d, generator=g).to(device, dtype).requires_grad_()
                for _ in range(3)]

    mask = torch.ones(2, tokens, dtype=torch.bool, device=device)
    mask[-1, tokens // 2:] = False
    blocks = 4 if side % 4 == 0 else 1
    index = segment_index((side, side), (blocks, blocks), 1, device)
    segments = token_segments((side, side), (blocks, blocks), 1, device)
    mixing = extended_block_mix(torch.rand(blocks * blocks, blocks * blocks, generator=g)).to(device).requires_grad_()
    norms = [(1 + torch.rand(2 * d, generator=g)).to(device).requires_grad_() for _ in range(2)]
    weights = (0.1 * torch.randn(3, 2, d, d, generator=g)).to(device).requires_grad_()
    filters = {size: (torch.randn(2 * d, 1, size, size, generator=g) / size).to(device).requires_grad_()
               for size in (3, 5)}
    bias = (0.1 * torch.randn(2 * d, generator=g)).to(device).requires_grad_()
    return {
        "linear_attention elu": lambda: fused.attention(*qkv(), mask, fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False),
        "linear_attention inline": lambda: fused.attention(*qkv(), mask, fused.IDENTITY, 0.0, 0.0, d ** -0.5, True),
        "blocked_attention mhla": lambda: fused.segmented_attention(*qkv(), mask, index, mixing, fused.RELU_PLUS_EPS,
                                                                    1e-6, 1e-6, *norms, 1e-6, filters[5], bias,
                                                                    (side, side), 1),  # (W̃ and LePE in its kernels)
        "pairwise_attention mhla": lambda: fused_pairwise.pairwise(*qkv(), mask, segments, mixing, fused.RELU_PLUS_EPS,
                                                                   1e-6, 1e-6, *norms, 1e-6, filters[5], bias,
                                                                   (side, side), 1),  # (LePE in its epilogues)
        "ttt_step": lambda: fused_ttt.call_step(*qkv(), mask, weights, d ** -0.5, 1.0, filters[3], bias,
                                                (side, side, 1), filters[3], bias, 1.0),  # (the key norm and
        # both convs in the op, as TTT runs it; split, the grid kernels' statistics and convs' backward too)
    }


OPS = ("linear_attention elu", "linear_attention inline", "blocked_attention mhla", "pairwise_attention mhla",
       "ttt_step", "linear_attention elu split", "ttt_step split")  # (measure's)


def measure(head_dims: list[int], device: torch.device, side: int = 16, ops: Optional[tuple[str, ...]] = None,
            arch: Optional[str] = None, dtype: torch.dtype = torch.bfloat16,
            max_registers: Optional[int] = None) -> list[dict[str, Any]]:
    """The builds of each op (all, or those named in ``ops``) at each head dim, on ``device`` or, with ``arch``,
    compiled for that GPU generation (:class:`CrossBuilds`); "linear_attention elu split" and "ttt_step split" are
    ELU and TTT with heads split over token ranges (the state and read-out kernels the other ops launch too; TTT's
    partial sums, W' formed by their last programs, and its read-out, where one program a head fuses them). TTT
    above its head-dim bound and on float32 inputs runs its torch step (dispatch.TTT_MAX_HEAD_DIM, TTT_DTYPES): its
    kernels are not built."""
    rows: list[dict[str, Any]] = []
    generation = None if arch is None else divmod(ARCHES[arch][0], 10)  # (the launch plan's: launch_plan.decide)
    for d in head_dims:
        calls = op_calls(d, device, side, dtype)
        calls["linear_attention elu split"] = calls["linear_attention elu"]
        calls["ttt_step split"] = calls["ttt_step"]
        for op, call in calls.items():
            if (ops is not None and op not in ops) or (op.startswith("ttt_step") and (
                    d > dispatch.TTT_MAX_HEAD_DIM or dtype not in dispatch.TTT_DTYPES)):
                continue
            programs = 1 << 20 if op.endswith("split") else None  # (heads over token ranges)
            print(f"building {op} at head dim {d}", file=sys.stderr, flush=True)  # (beside the table, not in it)
            builds = Builds(op) if arch is None else CrossBuilds(op, arch, max_registers)
            with dispatch.kernels_on(device.type, launcher=builds, programs=programs, capability=generation):
                call().float().square().mean().backward()
                eager = not dispatch.fits(op.split()[0])  # (the custom op's name: turned off here)
            rows += [{"head_dim": d, **row, "op_eager": eager} for row in builds.rows.values()]
    return rows


def number(value: Optional[int]) -> str:
    return "—" if value is None else str(value)


def print_table(rows: list[dict[str, Any]], device: torch.device, arch: Optional[str] = None,
                dtype: torch.dtype = torch.bfloat16) -> None:
    built = device.type == "cuda" or arch is not None
    if arch is not None:
        where = (f"{arch} by Triton's compiler and ptxas, nothing launched (shared memory per block: at most "
                 f"{ARCHES[arch][1]} bytes; blocks/SM: occupancy from registers, shared memory and warps)")
    else:
        where = torch.cuda.get_device_name(device) if built else "no GPU: Triton's interpreter builds nothing"
    print(f"Triton {dispatch.triton_version()}: fused kernels as built for {where}; "
          f"{str(dtype).removeprefix('torch.')} inputs; "
          f"{dispatch.CONFIG_ENV}={os.environ.get(dispatch.CONFIG_ENV, '(default)')}")
    print(f"{'d':>4}  {'op':26s} {'kernel':28s} {'BLOCK_N':>7} {'warps':>5} {'tile':>4} {'regs':>5} {'spills':>6} "
          f"{'shared':>7}" + ("  blocks/SM" if arch else ""))
    for row in rows:
        print(f"{row['head_dim']:>4}  {row['op']:26s} {row['kernel']:28s} {row.get('BLOCK_N', 0):>7} "
              f"{row.get('num_warps', 0):>5} {row.get('tile', ''):>4} {number(row['registers']):>5} "
              f"{number(row['spills']):>6} {number(row['shared_bytes']):>7}"
              + (f"  {row['blocks_per_sm']:>9}" if arch else "") + ("" if row.get("fits", True) else "  does not fit"))
    if built:
        for line in summary(rows):
            print(line)
    if arch is not None and divmod(ARCHES[arch][0], 10) < dispatch.MIN_CAPABILITY:
        print(f"dispatch runs the eager form on {arch} (before sm_80: dispatch.MIN_CAPABILITY); built here to show why")


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """What the rows say about the GPU: builds that spill, builds that did not fit (dispatch then tried leaner
    settings: dispatch.launch), the kernels that ran on leaner settings than their call site's, those that fit
    none (their op then launches other kernels, or runs its eager form), and the builds Triton's compiler refused."""
    ran = [r for r in rows if r.get("fits", True)]
    misfits = [r for r in rows if not r.get("fits", True) and "error" not in r]
    lines = []
    for what, bad, of in (("spill registers", [r for r in ran if r["spills"]], ran),
                          ("need more shared memory than a block may have", misfits, rows)):
        lines.append(f"{len(bad)} of {len(of)} builds {what}" + (
            ": " + ", ".join(sorted({f'{r["kernel"]} (d {r["head_dim"]})' for r in bad})) if bad else ""))
    lines += [misfit_line(place, ran, rows) for place in dict.fromkeys((r["head_dim"], r["op"], r["kernel"])
                                                                       for r in misfits)]
    lines += [f"not built: {r['kernel']} (d {r['head_dim']}, {r['op']}): {r['error']}" for r in rows if "error" in r]
    return lines


def misfit_line(place: tuple[int, str, str], ran: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """What happens to a kernel whose call site's settings did not fit: the leaner ones it ran on, or its op's
    fallback."""
    fitting = [r for r in ran if (r["head_dim"], r["op"], r["kernel"]) == place]
    where = f"{place[2]} (d {place[0]}, {place[1]})"
    if fitting:
        return f"runs lean: {where} on {fitting[-1]['tile']} tiles, BLOCK_N {fitting[-1]['BLOCK_N']}"
    if any(r["op_eager"] for r in rows if (r["head_dim"], r["op"]) == place[:2]):
        return f"fits no settings: {where}; that op runs its eager form on this GPU"
    return f"fits no settings: {where}; that op launches other kernels instead"


def parse_dims(text: str) -> list[int]:
    dims = [int(x) for x in text.split(",") if x.strip()]
    bad = [x for x in dims if not dispatch.MIN_HEAD_DIM <= x <= dispatch.MAX_HEAD_DIM]
    if not dims or bad:
        raise ValueError(f"head dims must be {dispatch.MIN_HEAD_DIM}..{dispatch.MAX_HEAD_DIM}, got {text!r}")
    return dims


def cross_build_error(arch: Optional[str]) -> Optional[str]:
    """Why ``--arch`` cannot build here, or None."""
    if arch is None:
        return None
    if arch not in ARCHES:
        return f"--arch: one of {', '.join(ARCHES)}, got {arch!r}"
    if dispatch.interpreting():
        return "--arch builds with Triton's compiler: unset TRITON_INTERPRET"
    try:
        import triton  # lazy: start-up time

        tools = [triton.knobs.nvidia.ptxas.path, triton.knobs.nvidia.cuobjdump.path]
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"--arch: this Triton has no NVIDIA build tools ({type(e).__name__}: {e})"
    missing = [t for t in tools if not t or not os.path.exists(t)]
    return f"--arch: missing {', '.join(map(str, missing))}" if missing else None


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default=None, help="comma-separated (default 64,128 on a GPU or with --arch, "
                                                          "32 in the interpreter)")
    parser.add_argument("--arch", default=None, help=f"build for this GPU generation, launching nothing: "
                                                     f"{', '.join(ARCHES)} (sm_75: T4; sm_80: A100; sm_89: L4, "
                                                     f"L40, RTX 4090; sm_90: H100, H200; sm_100: B200; "
                                                     f"sm_120: RTX 5090)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="the inputs' (default bfloat16, as autocast hands them over)")
    parser.add_argument("--ops", default=None, help=f"comma-separated, of: {', '.join(OPS)} (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--max-registers", type=int, default=None,
                        help="with --arch: cap every build at this many registers a thread (Triton's maxnreg), to "
                             "see what spills at the occupancy it gives")
    return parser


def argument_error(args: argparse.Namespace, device: torch.device) -> Optional[str]:
    """The one line that stops the run before any build (after ``error: ``), or None."""
    try:
        parse_dims(args.head_dims or "32")
    except ValueError as e:
        return f"--head-dims: {e}"
    ops = selected_ops(args.ops)
    if ops is not None and (not ops or set(ops) - set(OPS)):
        return f"--ops: comma-separated, of: {', '.join(OPS)}; got {args.ops!r}"
    if args.json is not None and not args.json.parent.is_dir():
        return f"--json: no folder {args.json.parent}"
    if args.max_registers is not None and (args.arch is None or not 24 <= args.max_registers <= 255):
        return f"--max-registers: 24..255, with --arch; got {args.max_registers}"
    problem = cross_build_error(args.arch)
    if problem is None and args.arch is None and device.type != "cuda" and not dispatch.interpreting():
        problem = "no GPU, and TRITON_INTERPRET=1 was not set before triton was imported (or pass --arch)"
    return problem


def selected_ops(text: Optional[str]) -> Optional[tuple[str, ...]]:
    return None if text is None else tuple(op.strip() for op in text.split(",") if op.strip())


def main(argv: Optional[list[str]] = None) -> int:
    args = arguments().parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() and args.arch is None else "cpu")
    problem = argument_error(args, device)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    dims = parse_dims(args.head_dims or ("32" if device.type == "cpu" and args.arch is None else "64,128"))
    rows = measure(dims, device, ops=selected_ops(args.ops), arch=args.arch, dtype=dtype,
                   max_registers=args.max_registers)
    print_table(rows, device, args.arch, dtype)
    if args.json is not None:
        write_text_atomic(args.json, json.dumps({"device": str(device), "arch": args.arch, "dtype": args.dtype,
                                                 "max_registers": args.max_registers,
                                                 "triton": dispatch.triton_version(),
                                                 "rows": rows}, indent=1))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
