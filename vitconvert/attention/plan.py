"""What each layer will run on a given GPU, dtype and size, as a value: the kernel plan.

:func:`plan_layer` is a pure function of a layer, a GPU's description (:data:`GPUS`, or the one at hand), the
q/k/v dtype, the batch and token counts and the launch settings. The state and read-out launches (ELU, ReLU,
InLine, MHLA's blocked form) take their chunk, warps, stages, tiles and token ranges from one value per shape
bucket, :func:`.ops.launch_plan.decide`'s (TTT's step its chunk, warps and ranges), and the plan holds the value it
gives (``KernelPlan.launches``);
for the rest it asks the rules the launches ask (:func:`.ops.dispatch.launch_geometry`,
:func:`.ops.dispatch.op_bounds`, :func:`.ops.pairwise.op.pairwise_is_cheaper`), so it needs no GPU, and tests hold
it against the launches recorded in Triton's interpreter. :func:`layer_plan` keeps each plan on its layer;
``vitconvert info FOLDER --kernels`` prints them per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from .base import LinearAttention
from .blocks import segment_index
from .ops import dispatch, launch_plan
from .ops.launch_plan import LinearLaunches, PairwiseLaunches
from .ops.pairwise.op import pairwise_is_cheaper
from .ops.settings import KernelSettings
from .ops.ttt.op import PARTIAL_SQUARES

FULL_SHARED_MEMORY = 227 * 1024  # what the launch settings are made for (an H100/H200's largest block)


@dataclass(frozen=True)
class Gpu:
    """What dispatch asks of a GPU: its generation, its streaming multiprocessors (programs a launch wants) and
    the shared memory one block may take (whether the launch settings fit as made)."""

    name: str
    capability: tuple[int, int]
    multiprocessors: int
    shared_memory: int  # bytes a block may take


GPUS = {  # (the vendors' data sheets; shared memory: the largest a block may opt into)
    "h100": Gpu("NVIDIA H100 SXM", (9, 0), 132, 227 * 1024),
    "h200": Gpu("NVIDIA H200", (9, 0), 132, 227 * 1024),
    "a100": Gpu("NVIDIA A100", (8, 0), 108, 163 * 1024),
    "l40": Gpu("NVIDIA L40", (8, 9), 142, 99 * 1024),
    "l4": Gpu("NVIDIA L4", (8, 9), 58, 99 * 1024),
    "a10": Gpu("NVIDIA A10", (8, 6), 72, 99 * 1024),
    "t4": Gpu("NVIDIA T4", (7, 5), 40, 64 * 1024),
    "v100": Gpu("NVIDIA V100", (7, 0), 80, 96 * 1024),
}


def local_gpu(device: torch.device) -> Gpu:
    """The description of a CUDA device at hand."""
    props = torch.cuda.get_device_properties(device)
    shared = getattr(props, "shared_memory_per_block_optin", FULL_SHARED_MEMORY)
    return Gpu(props.name, (props.major, props.minor), props.multi_processor_count, shared)


@dataclass(frozen=True)
class KernelPlan:
    """One layer's mixing on one GPU, dtype and size: the op and its launches, or why it runs eager."""

    layer: str
    variant: str
    op: Optional[str]  # the custom op the mixing takes; None: the eager form (``reason`` says why)
    forward: tuple[str, ...] = ()  # the op's kernels, in launch order
    backward: tuple[str, ...] = ()
    block_n: int = 0
    block_d: int = 0
    warps: int = 0
    stages: int = 0  # num_stages; 0: Triton's default (the launches pass none)
    tile: str = ""  # the dots' operands: "tf32", "bf16", "fp16" or "fp32"
    splits: int = 1  # token ranges per head and segment (1: a program per head, one launch each way)
    others: tuple[str, ...] = ()  # the layer's other ops on kernels (the grid op: LePE, TTT's convs)
    grid: Optional[launch_plan.GridLaunches] = None  # the grid op's launches, as they take them (with ``others``)
    launches: Optional[LinearLaunches] = None  # the state and read-out launches, as they take them (ops/launch_plan.py)
    pairwise: Optional[PairwiseLaunches] = None  # MHLA's pairwise launches, as they take them (ops/launch_plan.py)
    kept: tuple[str, ...] = ()  # what the op keeps for backward so that backward need not form it again (TTT's W')
    reason: str = ""  # why eager
    note: str = ""  # what may change at the first launch (less shared memory than the settings were made for)

    @property
    def on_kernels(self) -> bool:
        return self.op is not None


@dataclass(frozen=True)
class Call:
    """What a plan is computed for: the layer's q/k/v as a call would see them."""

    gpu: Optional[Gpu]  # None: the CPU
    dtype: torch.dtype
    batch: int
    tokens: int
    settings: KernelSettings
    older_triton: bool

    @property
    def programs(self) -> int:
        return dispatch.PROGRAMS_PER_SM * self.gpu.multiprocessors if self.gpu else 1


def plan_layer(module: LinearAttention, gpu: Optional[Gpu], dtype: torch.dtype, batch: int,
               tokens: Optional[int] = None, settings: Optional[KernelSettings] = None,
               older_triton: Optional[bool] = None, layer: str = "") -> KernelPlan:
    """The plan of ``module`` on ``gpu`` (None: the CPU) for a batch of ``tokens`` tokens (its grid's and prefix
    tokens when None) in ``dtype``; ``settings`` and ``older_triton`` as the launches would take them when None."""
    if tokens is None:
        grid = module.grid_size
        tokens = module.num_prefix_tokens + (grid[0] * grid[1] if grid else 0)
    call = Call(gpu, dtype, batch, tokens, settings or dispatch.launch_settings(),
                dispatch.older_triton() if older_triton is None else older_triton)
    base = KernelPlan(layer, module.variant, None)
    planner = PLANNERS.get(module.variant)
    if planner is None:
        return replace(base, reason="no fused kernels for this variant")
    op = OPS[module.variant]
    why = _eager_reason(module, call, op)
    if why:
        return replace(base, reason=why)
    plan = planner(module, call, replace(base, op=op))
    if plan.on_kernels and call.gpu is not None and call.gpu.shared_memory < FULL_SHARED_MEMORY:
        plan = replace(plan, note=f"{call.gpu.shared_memory // 1024} KB of shared memory a block (the settings are "
                                  f"made for {FULL_SHARED_MEMORY // 1024}): a kernel that does not fit runs on 16-bit "
                                  "tiles, then smaller BLOCK_N, from its first launch")
    return plan


def _eager_reason(module: LinearAttention, call: Call, op: str) -> str:
    """Why ``op``'s kernels do not take this call (:func:`.ops.dispatch.can_run`'s rules), or ""."""
    head_dim = module.head_dim
    max_head_dim, dtypes = dispatch.op_bounds(op, dispatch.Dispatch())
    if call.gpu is None:
        return "the CPU: the eager form (the kernels run on CUDA GPUs)"
    if getattr(module, "feature_map_q", None) is not None:
        return "feature_map=hedgehog (no kernels compute a trained φ)"
    if not call.settings.fused or not module.fused_kernels:
        return f"{dispatch.ENV}=0 (or Triton is not installed)"
    if call.gpu.capability < dispatch.MIN_CAPABILITY:
        return f"sm_{call.gpu.capability[0]}{call.gpu.capability[1]}: the kernels need sm_80 or later"
    if call.dtype not in dtypes:
        return f"{str(call.dtype).removeprefix('torch.')} inputs: its kernels take " + \
            ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    if not dispatch.MIN_HEAD_DIM <= head_dim <= max_head_dim:
        return f"head dim {head_dim}: its kernels take {dispatch.MIN_HEAD_DIM}..{max_head_dim}"
    if getattr(module, "official_denominator", False):
        return "the official denominator (no kernels for it)"
    return ""


def _tf32_matmuls(call: Call) -> bool:
    return call.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


def _geometry(plan: KernelPlan, module: LinearAttention, call: Call) -> KernelPlan:
    """The pairwise kernels' launch settings (no num_stages given: Triton's default)."""
    block_n, block_d, warps = dispatch.launch_geometry(module.head_dim, call.settings.config)
    return replace(plan, block_n=block_n, block_d=block_d, warps=warps, stages=0,
                   tile=launch_plan.tile_name(call.dtype, call.settings, False, _tf32_matmuls(call)))


def _launches(plan: KernelPlan, module: LinearAttention, call: Call, segments: int, length: int,
              bf16_tiles: bool, many_tiles: bool = False, partial_squares: int = 0) -> KernelPlan:
    """The plan on the launches the state and read-out kernels take (:func:`.ops.launch_plan.decide`, as they ask
    it), for ``segments`` segments of ``length`` tokens."""
    found = launch_plan.decide(call.batch * module.num_heads, segments, math.ceil(length / dispatch.SPLIT_ROUND),
                               module.head_dim, call.dtype, call.programs, dispatch.SPLIT_ROUND, call.settings,
                               call.older_triton, _tf32_matmuls(call), bf16_tiles, many_tiles,
                               call.gpu is not None and call.gpu.capability < launch_plan.HOPPER, partial_squares)
    return replace(plan, block_n=found.block_n, block_d=found.block_d, warps=found.warps, stages=found.stages,
                   tile=found.tile, splits=found.splits, launches=found)


def _chunked(kernel: str, block_n: int, plan: KernelPlan) -> str:
    """A kernel's name, with its BLOCK_N where it takes another than the plan's."""
    return kernel + (f" (BLOCK_N {block_n})" if block_n != plan.block_n else "")


def _linear(module: LinearAttention, call: Call, plan: KernelPlan) -> KernelPlan:
    """ELU, ReLU, InLine: one launch each way when every head fits one program, else the state and read-out."""
    plan = _launches(plan, module, call, 1, call.tokens, True)
    found = plan.launches
    split_backward = ("state_fwd_kernel", _chunked("readout_bwd_kernel", found.readout_bwd_block_n, plan),
                      "state_bwd_kernel")
    if not found.one_launch:
        return replace(plan, forward=("state_fwd_kernel", "readout_fwd_kernel"), backward=split_backward)
    one_launch = (_chunked("attention_bwd_kernel", found.one_launch_bwd_block_n, plan),)
    return replace(plan, forward=("attention_fwd_kernel",),
                   backward=one_launch if found.one_launch_backward else split_backward)


def _grid_op(module: LinearAttention, call: Call) -> Optional[launch_plan.GridLaunches]:
    """The grid op's launches where the layer has a grid and the op's kernels take the call."""
    if module.grid_size is None or _eager_reason(module, call, "grid_conv"):
        return None
    return launch_plan.decide_grid(module.head_dim, call.settings.config)


def _on_the_grid_op(plan: KernelPlan, grid: launch_plan.GridLaunches, *kernels: str) -> KernelPlan:
    """``plan`` with the grid op's ``kernels`` as its others, on ``grid``'s launches."""
    how = f" (BLOCK_M {grid.block_m}, {grid.warps} warps)"
    return replace(plan, others=tuple(kernel + how for kernel in kernels), grid=grid)


def _mhla(module: LinearAttention, call: Call, plan: KernelPlan) -> KernelPlan:
    """MHLA: the pairwise form (N×N tiles, LePE in its kernels' epilogues) or the blocked one (block states mixed by
    the state kernel's last programs, then read; LePE in the read-out's and state backward's), whichever moves less."""
    plan = _geometry(plan, module, call)
    grid = module.grid_size
    counts = module.block_counts
    segments = counts[0] * counts[1] + 1 if grid else 1
    if grid and pairwise_is_cheaper(call.tokens, segments, module.head_dim, call.dtype, call.settings.form):
        normed = getattr(module, "q_rmsnorm", None) is not None
        found = launch_plan.decide_pairwise(module.head_dim, call.dtype, normed, call.settings, call.older_triton,
                                            _tf32_matmuls(call))
        return replace(plan, op="pairwise_attention", block_n=found.block_m, warps=found.warps, tile=found.tile,
                       pairwise=found, forward=("pairwise_fwd_kernel",),  # (q and k's RMSNorm as the tiles load)
                       backward=(f"pairwise_bwd_kernel (BLOCK_M {found.backward_block_m}, BLOCK_N "
                                 f"{found.backward_block_n}, {found.backward_warps} warps, {found.backward_tile} "
                                 "tiles)",))  # (a program per batch·head, the norm's backward in its epilogues)
    length = segment_index(grid, counts, module.num_prefix_tokens, torch.device("cpu")).shape[1] if grid else \
        call.tokens
    plan = _launches(plan, module, call, segments, length, False)
    readout_bwd = _chunked("readout_bwd_kernel", plan.launches.readout_bwd_block_n, plan)
    # (q/k's RMSNorm as the tiles load, each token's 1/rms over heads taken by the forward's kernels there:
    # ops/linear/norm_parts.py; W̃'s mixing in the state kernel's last programs, LePE in the read-out's and the state
    # backward's epilogues, the weights' gradients summed over the batch in their last)
    return replace(plan, forward=("state_fwd_kernel", "readout_fwd_kernel"),
                   backward=("state_fwd_kernel", readout_bwd, "state_bwd_kernel"))


def _ttt(module: LinearAttention, call: Call, plan: KernelPlan) -> KernelPlan:
    """TTT's step: where a program owns each head, one kernel each way (backward recomputes W'); where heads split over
    token ranges, the partial sums (W' formed by their last programs) and the read-out, and backward W' again, the
    read-out's and the sums' backward, W' formed again only where the forward did not keep it
    (``LinearLaunches.keeps_summed``: kept where softmax's attention keeps as much more than TTT's; ``kept``). Where the
    layer has a grid and the grid op's kernels take the call, the key norm and the convs are applied in the op's kernels
    and the op keeps what it recomputes: in one program a head, the key statistics and the convs' backward are the step
    kernels' too; split, the statistics are the grid op's reading pass and the convs' backward its kernel. Else they run
    in torch before the op and the layer's step is recomputed in backward when the layer recomputes it."""
    # (the step's chunk, warps and token ranges as ops/ttt/op.py's launches take them; no num_stages given)
    plan = _launches(plan, module, call, 1, call.tokens, False, True, PARTIAL_SQUARES)
    kept = ("W'",) if plan.launches.keeps_summed else ()
    plan = replace(plan, stages=0, launches=None, kept=kept)
    half = f" ({launch_plan.HALF_TILES[call.dtype]} tiles)" if call.dtype in launch_plan.HALF_TILES else ""
    if plan.splits == 1:  # (backward: 16-bit tiles, dispatch.tile_args)
        forward, backward = ("ttt_fwd_kernel",), (f"ttt_bwd_kernel{half}",)
    else:
        forward = ("inner_sums_kernel", "swiglu_readout_kernel")
        sums_again = () if kept else ("inner_sums_kernel",)
        backward = (*sums_again, f"swiglu_readout_bwd_kernel{half}", f"inner_sums_bwd_kernel{half}")
    on_grid = _grid_op(module, call)
    again = forward if getattr(module, "recompute_step", False) and not on_grid else ()
    plan = replace(plan, forward=forward, backward=(*again, *backward))
    if on_grid is None or plan.splits == 1:
        return plan
    return _on_the_grid_op(plan, on_grid, "key_moments_kernel", "grid_conv_bwd_kernel")


PLANNERS: dict[str, Callable[[LinearAttention, Call, KernelPlan], KernelPlan]] = {
    "elu": _linear, "relu": _linear, "inline": _linear, "mhla": _mhla, "ttt": _ttt}
OPS = {"elu": "linear_attention", "relu": "linear_attention", "inline": "linear_attention",
       "mhla": "blocked_attention", "ttt": "ttt_step"}  # (the op whose bounds decide; MHLA may take its pairwise op)


def linear_layers(model: nn.Module) -> Iterator[tuple[str, LinearAttention]]:
    for name, module in model.named_modules():
        if isinstance(module, LinearAttention):
            yield name, module


def layer_plan(module: LinearAttention, gpu: Optional[Gpu], dtype: torch.dtype, batch: int,
               tokens: Optional[int] = None, settings: Optional[KernelSettings] = None,
               older_triton: Optional[bool] = None, layer: str = "") -> KernelPlan:
    """:func:`plan_layer`, kept by the layer (``module.kernel_plans``) per GPU, dtype, size and settings: decided
    the first time one is asked, the same value after that."""
    settings = settings or dispatch.launch_settings()
    older = dispatch.older_triton() if older_triton is None else older_triton
    key = (gpu, dtype, batch, tokens, settings, older, layer)
    plans = module.__dict__.setdefault("kernel_plans", {})  # (a plain attribute: no parameter, buffer or module)
    found = plans.get(key)
    if found is None:
        found = plans[key] = plan_layer(module, gpu, dtype, batch, tokens, settings, older, layer)
    return found


def plan_model(model: nn.Module, gpu: Optional[Gpu], dtype: torch.dtype, batch: int,
               settings: Optional[KernelSettings] = None) -> list[KernelPlan]:
    """:func:`layer_plan` of every linear-attention layer of ``model``, at its grid's size."""
    return [layer_plan(module, gpu, dtype, batch, settings=settings, layer=name)
            for name, module in linear_layers(model)]
