"""When the fused kernels run, and how they are launched: the dispatch rule, the launch geometry, the dots'
precision, and what happens when Triton cannot build a kernel for the GPU at hand.

Dispatch is chosen once per module, like timm's ``fused_attn``: :func:`use_fused_kernels` (Triton installed and
``VITCONVERT_FUSED`` not "0") at construction, which also reads the other settings once (:class:`.KernelSettings`),
then :func:`can_run` per call on what only the call knows (a CUDA tensor on an Ampere or later GPU, a supported
dtype and head dim, not tracing for ONNX). Anything else takes the eager form. What a layer will run on a given GPU,
dtype and size, as a value: :mod:`.plan`.

Everything a launch consults that is not its tensors is one :class:`Dispatch` value, the context's
(:func:`current`): the settings, the devices the kernels run on, what this process found does not fit the GPU.
Diagnostics and tests change it for a block (:func:`kernels_on`, :func:`launches_through`), never by rebinding
module globals.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import warnings
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Optional

import torch
from packaging.version import InvalidVersion, Version

from .dispatch_context import (  # noqa: F401  (re-exported: dispatch's one home for callers)
    SPLIT_ROUND,
    TTT_DTYPES,
    Dispatch,
    current,
    environment_settings,
    kernels_on,
    launch_settings,
)
from .settings import (  # noqa: F401  (re-exported: the ops, tools and tests read the settings here)
    CONFIG_ENV,
    ENV,
    FORM_ENV,
    FORMS,
    TILE_ENV,
    KernelSettings,
    config_setting,
    form_setting,
    fused_switch,
    tile_setting,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
# TTT's kernels hold up to a dozen d×d operands: above head dim 64 (a 128 tile) they do not fit sm_90's shared
# memory a block, nor on float32 inputs (benchmarks/kernel_resources.py --arch). Those run TTT's torch step.
TTT_MAX_HEAD_DIM = 64
# Ampere on: bf16 and TF32 tensor-core dots. Built for a V100 (sm_70) or T4 (sm_75) the kernels do not fit
# (benchmarks/kernel_resources.py --arch sm_75); there the eager form's cuBLAS matmuls run instead
MIN_CAPABILITY = (8, 0)
PROGRAMS_PER_SM = 4  # programs a launch wants per streaming multiprocessor before heads split over token ranges


TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # once, at import (cheap; no triton import)


def triton_available() -> bool:
    return TRITON_INSTALLED


def triton_version() -> Optional[str]:
    """Triton's version as installed (without importing it), or None: kernels build differently across versions,
    so the benchmarks' reports name it."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def use_fused_kernels() -> bool:
    """The module-level choice (read at construction): on unless ``VITCONVERT_FUSED=0`` or Triton is missing.
    The four variables are checked here, where a bad one can still be a one-line error (a launch is deep in a
    forward pass) and not a silent default: ``VITCONVERT_FUSED=false`` meant off, and ran the kernels."""
    settings = KernelSettings.read()
    environment_settings()  # (the launches' settings: read with the first model built, never by a launch)
    return settings.fused and triton_available()


class KernelUnavailable(RuntimeError):
    """Triton could not build a kernel for this GPU (registers, shared memory, an unsupported instruction).
    ``resources``: it built, but needs more shared memory or threads than the GPU gives a block, so leaner launch
    settings may fit (:func:`launch`)."""

    def __init__(self, message: str, resources: bool = False) -> None:
        super().__init__(message)
        self.resources = resources


MIN_BLOCK_N = 16  # the smallest token chunk a lean launch takes (a tensor-core dot's least M)


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> Any:
    """:func:`build_and_run`, or the launcher a benchmark put in its place (:func:`launches_through`), on the
    settings the call site chose or, where they do not fit this GPU, the first leaner ones that do
    (:func:`leaner`): the launch settings are made for an H100/H200 (227 KB of shared memory a block), an A100
    gives 163 KB and an L40, L4, A10 or RTX 3090/4090 99 KB (benchmarks/kernel_resources.py --arch). What fits is
    remembered per kernel and settings, so only a kernel's first launch on a GPU tries and fails; when nothing
    fits, :class:`KernelUnavailable` reaches the op (which then runs its eager form)."""
    dispatch = current()
    run = build_and_run if dispatch.launcher is None else dispatch.launcher
    key = (kernel, args[0].device, kwargs["BLOCK_N"], kwargs["BLOCK_D"], kwargs["TILE"], kwargs["num_warps"])
    settled = dispatch.settled.get(key)
    settings = kwargs if settled is None else {**kwargs, **settled}
    while True:
        try:
            return run(kernel, grid, *args, **settings)
        except KernelUnavailable as e:
            step = leaner(settings, args[0].dtype) if e.resources else None
            if step is None:
                raise
            settings = {**settings, **step}
            dispatch.settled[key] = {**dispatch.settled.get(key, {}), **step}


def leaner(settings: dict[str, Any], dtype: torch.dtype) -> Optional[dict[str, Any]]:
    """The next step down from a launch's ``settings`` that did not fit: half inputs' dots on 16-bit tiles (the
    operands autocast's own matmuls take; TF32 tiles take twice the shared memory), then half the token chunk
    (down to :data:`MIN_BLOCK_N`); None after the last. The kernels' results do not depend on the chunk, and on
    16-bit tiles only by the operands' rounding (tests/attention/test_fused.py)."""
    import triton.language as tl  # lazy: start-up time (only when a kernel did not fit)

    if settings["TILE"] == tl.float32 and dtype in (torch.float16, torch.bfloat16):
        return {"TILE": tl.bfloat16 if dtype == torch.bfloat16 else tl.float16, "PRECISION": "ieee"}
    if settings["BLOCK_N"] > MIN_BLOCK_N:
        return {"BLOCK_N": settings["BLOCK_N"] // 2}
    return None


def kernel_name(kernel: Any) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", type(kernel).__name__)


def build_and_run(kernel, grid: tuple[int, ...], *args, **kwargs) -> Any:
    """``kernel[grid](*args, **kwargs)``, with Triton's build failures as :class:`KernelUnavailable` (the
    interpreter's errors are bugs, and stay what they are). Returns what Triton returns: the compiled kernel on a
    GPU (benchmarks/kernel_resources.py reads its resources)."""
    from triton.runtime.errors import (  # lazy: start-up time (triton on first launch)
        InterpreterError,
        OutOfResources,
        TritonError,
    )

    if interpreting():
        _no_interpreter_overflow_checks()
    try:
        return kernel[grid](*args, **kwargs)
    except InterpreterError:
        raise
    except TritonError as e:
        reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        raise KernelUnavailable(f"the fused linear-attention kernels cannot run on this GPU ({reason}); "
                                f"{ENV}=0 selects the eager form", resources=isinstance(e, OutOfResources)) from e


@lru_cache(maxsize=1)
def _no_interpreter_overflow_checks() -> None:
    """Triton's interpreter runs an overflow check beside every int32 add, sub and mul (int64 casts, two compares)
    and then drops its assert, its options' ``debug`` being off, as a GPU build without debug does: the checks took
    over half the CPU time of the interpreted MHLA kernels (cProfile of a blocked-MHLA module test). Off, the
    kernels compute the same values in under half the time."""
    from triton.runtime import interpreter  # lazy: start-up time

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if getattr(options, "sanitize_overflow", False) and not options.debug:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def launches_through(launcher: Callable[..., Any], device_type: str):
    """:func:`kernels_on` ``device_type`` with every kernel launch through ``launcher(kernel, grid, *args,
    **kwargs)``, which may count, record or skip it and calls :func:`build_and_run` to run it
    (benchmarks/host_overhead.py, benchmarks/kernel_resources.py)."""
    return kernels_on(device_type, launcher=launcher)


def fits(form: str) -> bool:
    """Whether ``form`` (an op, or a kernel an op has another way around) has not been found too big for this GPU
    (:func:`too_big`, :func:`disable`)."""
    return form not in current().unavailable


def too_big(form: str, error: KernelUnavailable) -> None:
    """Remember that ``form`` fits this GPU at no settings (:func:`launch`), without a warning: its op takes its
    other way from now on (TTT's sums' backward: two kernels instead of one; ops/ttt/op.py)."""
    current().unavailable[form] = str(error)


def disable(error: KernelUnavailable, op: str) -> None:
    """Turn ``op``'s kernels off for this process after a call could not build one: once per op, with a warning;
    the call that failed and every later one of that op run the eager form. The other ops keep theirs: what does
    not fit one GPU at any settings (:func:`launch`) is one op's kernel, and a benchmark of every variant in one
    process would otherwise time the rest eager."""
    unavailable = current().unavailable
    if op not in unavailable:
        warnings.warn(f"{error} (for {op}; the other ops keep their kernels)", RuntimeWarning, stacklevel=3)
        unavailable[op] = str(error)


def attempt(op: str, mix: Callable[..., torch.Tensor], *args: Any) -> Optional[torch.Tensor]:
    """``mix(*args)`` on ``op``'s kernels, or None after :func:`disable` when Triton cannot build them here (the
    caller then runs its eager form). A function of its own: TorchScript parses even the skipped branches of a
    scripted ``forward`` and has no ``try``."""
    try:
        return mix(*args)
    except KernelUnavailable as e:
        disable(e, op)
        return None


def can_run(t: torch.Tensor, op: str) -> bool:
    """Whether ``op``'s kernels (the custom op's name: "linear_attention", "blocked_attention", "ttt_step", …) take
    this call's q/k/v (the per-call half of dispatch; anything else runs eager): :func:`op_bounds` says which head
    dims and dtypes an op's kernels fit an sm_90 GPU at."""
    dispatch = current()
    if op in dispatch.unavailable or torch.onnx.is_in_onnx_export():
        return False
    max_head_dim, dtypes = op_bounds(op, dispatch)
    return (t.device.type in dispatch.devices and t.dtype in dtypes and MIN_HEAD_DIM <= t.shape[-1] <= max_head_dim
            and triton_available()
            and (t.device.type not in dispatch.generation_checked or supported_generation(t.device)))


def op_bounds(op: str, dispatch: Optional[Dispatch] = None) -> tuple[int, tuple[torch.dtype, ...]]:
    """(largest head dim, dtypes) ``op``'s kernels take: TTT's step its own (:data:`TTT_MAX_HEAD_DIM`, the
    dispatch's ``ttt_dtypes``), every other op :data:`MAX_HEAD_DIM` and :data:`DTYPES`."""
    if op == "ttt_step":
        return TTT_MAX_HEAD_DIM, (dispatch or current()).ttt_dtypes
    return MAX_HEAD_DIM, DTYPES


@torch.compiler.assume_constant_result
def supported_generation(device: torch.device) -> bool:
    """Whether the GPU is sm_80 or later (:data:`MIN_CAPABILITY`), asked once per device (can_run asks on every
    call). torch.compile calls it while tracing a forward and takes the answer as a constant, instead of tracing
    into torch.cuda (fullgraph). A bool, not the (major, minor) tuple: torch 2.11's dynamo cannot compare a
    constant tuple it did not trace (an internal error, not a graph break). (The answers are kept in a dict of the
    dispatch, not an lru_cache, which dynamo traces through, with a warning.)"""
    found = current().capabilities
    if device not in found:
        found[device] = torch.cuda.get_device_capability(device) >= MIN_CAPABILITY
    return found[device]


def direct(t: torch.Tensor) -> bool:
    """Whether an op call may skip PyTorch's custom-op dispatcher and run its Python body through an
    ``autograd.Function`` (ops/linear/op.py): a plain eager call on a plain tensor. The dispatcher and the custom op's
    autograd cost tens of µs of host time per op, forward and backward, in every layer
    (benchmarks/host_overhead.py); the compiler, torch.export, FX, ``torch.jit.trace``, dispatch-mode tracers
    (make_fx, FLOP and traffic counters) and functorch transforms still see the custom ops."""
    if torch.compiler.is_compiling():  # (first: the compiler stops there)
        return False
    here = current()
    return (not here.through_ops and type(t) is torch.Tensor
            and (here.direct_under_modes or torch._C._len_torch_dispatch_stack() == 0)
            and not torch._C._are_functorch_transforms_active()
            and not torch.jit.is_tracing())  # a trace records ops: the Function's launch would be left out


def exporting() -> bool:
    """Whether torch.export is tracing. The flag torch.export sets (torch >= 2.5), read directly where it exists:
    torch 2.11's dynamo (not 2.14's) folds ``torch.compiler.is_exporting()`` to True under every
    torch.compile, which turned TTT's recomputation and the lean norms off in compiled training."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if flag is not None:
        return bool(flag)
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return is_exporting is not None and is_exporting()


@lru_cache(maxsize=1)
def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (read once: Triton chooses it when it is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# -- launch geometry -------------------------------------------------------------------------------------
def block_sizes(head_dim: int, many_tiles: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_D, num_warps) of the context's settings (:func:`launch_geometry`)."""
    return launch_geometry(head_dim, launch_settings().config, many_tiles)


@lru_cache(maxsize=64)  # per launch, so cached: host time (benchmarks/host_overhead.py)
def launch_geometry(head_dim: int, config: Optional[tuple[int, int, int]],
                    many_tiles: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_D, num_warps): a power-of-two head tile, token chunks that keep the d×d state and one tile
    of tokens in registers. ``many_tiles``: kernels that hold several d×d matrices (TTT's: up to a dozen and three
    accumulators) take half the chunk and twice the warps from head dim 64 up, the one of BLOCK_N 16/32/64 ×
    4/8 warps whose TTT kernels fit sm_90 at head dim 64 (benchmarks/kernel_resources.py --arch sm_90; their speed
    is not measured). ``config`` (``VITCONVERT_FUSED_CONFIG=BLOCK_N,num_warps``) overrides every kernel's (for
    tuning sweeps)."""
    block_d = max(16, triton_next_power_of_2(head_dim))
    if config:
        block_n, warps, _ = config
        return block_n, block_d, warps
    if block_d >= 128 or (many_tiles and block_d >= 64):
        return 32, block_d, 8
    return 64, block_d, 4


def spill_free_chunk(block_n: int, block_d: int) -> int:
    """The token chunk of the two backward kernels that Triton before 3.8 builds with spilled registers at head
    dim 64 for sm_90 (ELU/ReLU/InLine's one-launch backward, MHLA's pairwise dk/dv): half of it there
    (benchmarks/kernel_resources.py --arch sm_90 says what each Triton builds). ``VITCONVERT_FUSED_CONFIG`` keeps
    its chunk."""
    dispatch = current()
    older = older_triton() if dispatch.older_triton is None else dispatch.older_triton
    return backward_chunk(block_n, block_d, (dispatch.settings or environment_settings()).config is not None, older)


def backward_chunk(block_n: int, block_d: int, configured: bool, older: bool) -> int:
    """:func:`spill_free_chunk` as a pure function (:mod:`.plan` asks it for a Triton it names)."""
    if block_d != 64 or not older or configured:
        return block_n
    return max(16, block_n // 2)


@lru_cache(maxsize=1)
def older_triton() -> bool:
    """Whether the installed Triton is older than 3.8 (read once: a launch asks)."""
    return older_than_3_8(triton_version())


def older_than_3_8(version: Optional[str]) -> bool:
    """Whether a Triton ``version`` is before 3.8, parsed as the dependency check parses versions (packaging), so a
    local build such as ``3.6.0+git`` counts as its release; None or unreadable: no."""
    try:
        return Version(version or "").release < (3, 8)
    except InvalidVersion:  # not installed, or a version packaging cannot read
        return False


def triton_next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@lru_cache(maxsize=8)
def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (asked once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def programs_wanted(device: torch.device) -> int:
    """Programs a launch wants before heads split over token ranges: the dispatch's, or
    :data:`PROGRAMS_PER_SM` per SM of a CUDA device (1 elsewhere)."""
    programs = current().programs
    if programs is not None:
        return programs
    return PROGRAMS_PER_SM * multiprocessors(device) if device.type == "cuda" else 1


def split_tokens(heads: int, segments: int, length: int, device: torch.device) -> tuple[int, int]:
    """(splits, tokens per split): cut each segment's tokens into ranges until the GPU has enough programs."""
    return token_ranges(heads, segments, length, programs_wanted(device), current().split_round)


def token_ranges(heads: int, segments: int, length: int, programs: int,
                 split_round: int = SPLIT_ROUND) -> tuple[int, int]:
    """:func:`split_tokens` as a pure function of the programs wanted (:mod:`.plan` asks it for a GPU it names)."""
    chunks = max(1, math.ceil(length / split_round))
    splits = min(chunks, max(1, math.ceil(programs / max(1, heads * segments))))
    per = math.ceil(chunks / splits) * split_round
    return max(1, math.ceil(length / per)), per


def tile_args(t: torch.Tensor, half_tiles: bool = False) -> dict:
    """The dots' operand type and precision (ops/linear/kernel_parts.py): half inputs as TF32 tiles
    (``VITCONVERT_FUSED_TILE=half`` keeps them 16-bit), float32 inputs as torch's TF32 switch for matmuls says
    (never turned on here). ``half_tiles``: half inputs as 16-bit tiles always, as autocast's own backward
    multiplies them, for kernels that hold so many d×d operands that TF32 tiles overflow shared memory (TTT's
    backward at head dim 64 on sm_90; benchmarks/kernel_resources.py --arch)."""
    tf32_matmuls = t.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    tile = "half" if half_tiles else launch_settings().tile
    return _tile_args(t.dtype, tf32_matmuls, tile, interpreting())


@lru_cache(maxsize=32)  # per launch, so cached (the caller only unpacks the dict)
def _tile_args(dtype: torch.dtype, tf32_matmuls: bool, tile: str, emulate: bool) -> dict:
    import triton.language as tl

    if dtype != torch.float32 and tile == "half":
        return {"TILE": tl.bfloat16 if dtype == torch.bfloat16 else tl.float16, "PRECISION": "ieee",
                "EMULATE": emulate}
    tf32 = dtype != torch.float32 or tf32_matmuls
    return {"TILE": tl.float32, "PRECISION": "tf32" if tf32 else "ieee", "EMULATE": emulate}
