"""What the ELU/ReLU/InLine and MHLA-blocked launches take, decided once per shape bucket: a :class:`LinearLaunches`
value (tile, warps, stages, token ranges, each backward kernel's chunk, one launch or split).

:func:`decide` is a pure function of the heads, segments, head dim and dtype of a call, the tokens' bucket (token
count rounded up to the dispatch's ``split_round``: every split decision is a function of it), the programs the GPU
wants and the launch settings; it is cached, so a bucket's launches are decided at its first call and read after
that. The launches (ops/linear/launches.py, ops/linear/op.py) ask :func:`linear_launches`, which fills in what the
context knows (:mod:`.dispatch_context`); the kernel plan (attention/plan.py) asks :func:`decide` for a GPU it names,
so what ``vitconvert info --kernels`` prints is what the launches take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from .dispatch import (
    PROGRAMS_PER_SM,
    SPLIT_ROUND,
    backward_chunk,
    current,
    environment_settings,
    interpreting,
    launch_geometry,
    older_triton,
    programs_wanted,
    token_ranges,
    triton_next_power_of_2,
)
from .settings import KernelSettings

# The one-launch backward holds Rᵀ, dR, dS and dSᵀ as head-dim tiles at once: above head dim 64 the three-launch
# form runs (what each builds to: benchmarks/kernel_resources.py --arch sm_90 --ops "linear_attention elu").
ONE_LAUNCH_BACKWARD_MAX_HEAD_DIM = 64
HALF_TILES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
HOPPER = (9, 0)  # the first generation whose dots read operands from shared memory (wgmma)
# A grid kernel's program's tokens × head channels (TTT's key statistics and convs' backward where heads split).
# Every tap is a shifted load of the tile, and Triton keeps several in flight: 32 × 64 on 8 warps, where the
# attention kernels take 64 × 64 on 4 (benchmarks/kernel_resources.py --arch sm_90 --ops "ttt_step split"). Their
# speed is not measured.
GRID_TILE_ELEMENTS = 2048
# What a token range's partial sums may weigh against the keys and values it reads (:func:`shortest_range`): at most
# as many bytes. TTT's three d×d float32 sums a range are 48 KB at head dim 64, a 128-token range's bf16 keys and
# values 32 KB (ELU's one state, 16.6 KB, about half: the linear-attention launches pass no partial sums to weigh).
PARTIAL_SHARE = 1.0
# What a batch·head's summed partials (TTT's W') may weigh to be kept from the forward for the backward
# (:func:`keeps_summed`): at most KEPT_SHARE of its q, and no more than softmax's attention keeps beyond TTT's, so that
# TTT's autograd keeps no more than softmax's (benchmarks/saved_memory.py): both keep q, k, v and the projection's
# input, softmax's SDPA its logsumexp too (SOFTMAX_EXTRA_BYTES a token a head), TTT its keys' statistics (2·d float32
# a head). The second binds: at head dim 64, 16-bit W' fits from about 6.3k tokens, float32 W' from about 12.4k.
KEPT_SHARE = 1.0
SOFTMAX_EXTRA_BYTES = 4


@dataclass(frozen=True)
class LinearLaunches:
    """One shape bucket's launches of the state and read-out kernels (and the one-launch kernels of ELU, ReLU,
    InLine): what each launch takes instead of deciding it."""

    block_n: int
    block_d: int
    warps: int
    stages: int
    tile: str  # the dots' operands: "tf32", "fp32", "bf16" or "fp16" (:func:`tile_kwargs`)
    splits: int  # the state pass's token ranges per head and segment (1: a head in one program, one launch a way)
    per: int  # tokens a state range takes
    read_splits: int  # the read-out's and the state backward's ranges (no reduction over tokens: shorter ones)
    read_per: int
    readout_bwd_block_n: int  # readout_bwd_kernel's chunk
    one_launch_bwd_block_n: int  # attention_bwd_kernel's chunk
    one_launch_backward: bool  # a head in one program and a head dim attention_bwd_kernel fits
    keeps_summed: bool = False  # split, the last programs' sums (TTT's W') kept for backward (:func:`keeps_summed`)

    @property
    def one_launch(self) -> bool:
        return self.splits == 1


def shortest_range(partial_squares: int, head_dim: int, dtype: torch.dtype, split_round: int) -> int:
    """The fewest tokens (a multiple of ``split_round``) a range may take whose partial sums, ``partial_squares`` d×d
    float32 matrices written once and read back once by its head's last program, weigh at most
    :data:`PARTIAL_SHARE` of the keys and values it reads (2·d elements of ``dtype`` a token); ``split_round``
    without partial sums to weigh. Shorter ranges gain programs but write more partial bytes than that."""
    partial_bytes = partial_squares * head_dim * head_dim * 4
    token_bytes = 2 * head_dim * dtype.itemsize * PARTIAL_SHARE
    return max(1, math.ceil(partial_bytes / token_bytes / split_round)) * split_round


def kept_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype summed partials are kept in for the backward (:func:`keeps_summed`): the backward's tiles', 16-bit
    for 16-bit inputs (:func:`.dispatch.tile_args` with ``half_tiles``), so keeping them rounds nothing the backward
    would not; float32 otherwise."""
    return dtype if dtype in HALF_TILES else torch.float32


def keeps_summed(partial_squares: int, head_dim: int, dtype: torch.dtype, chunks: int, split_round: int,
                 softmax_extra_bytes: int = SOFTMAX_EXTRA_BYTES) -> bool:
    """Whether a batch·head's summed partials, ``partial_squares`` d×d matrices of :func:`kept_dtype`, weigh at most
    :data:`KEPT_SHARE` of its q (d elements of ``dtype`` a token) and at most what softmax's attention keeps beyond
    TTT's (``softmax_extra_bytes`` a token, less 2·d float32) for every token count of the bucket (more than
    ``chunks − 1`` and at most ``chunks`` times ``split_round``): then the forward keeps them for the backward, which
    skips the launch that would form them again (a pass over the keys); else the backward forms them again (no
    partials: never kept)."""
    tokens = (chunks - 1) * split_round + 1
    kept = partial_squares * head_dim * head_dim * kept_dtype(dtype).itemsize
    room = min(KEPT_SHARE * tokens * head_dim * dtype.itemsize, tokens * softmax_extra_bytes - 2 * head_dim * 4)
    return 0 < kept <= room


def bounded_ranges(heads: int, segments: int, length: int, programs: int, split_round: int,
                   shortest: int) -> tuple[int, int]:
    """(splits, tokens per split): :func:`.dispatch.token_ranges`, with ranges lengthened towards ``shortest``
    (:func:`shortest_range`) but no longer than the ranges of one program an SM (token_ranges for ``programs`` /
    :data:`.dispatch.PROGRAMS_PER_SM`): for a kernel that holds one block an SM (TTT's), one wave of ranges twice as
    long should take about the time of the two waves of shorter ones it replaces (not measured on a GPU), and it
    writes half the partial sums."""
    splits, per = token_ranges(heads, segments, length, programs, split_round)
    if per >= shortest:
        return splits, per
    filled = token_ranges(heads, segments, length, max(1, programs // PROGRAMS_PER_SM), split_round)[1]
    per = max(per, min(shortest, filled))
    return math.ceil(length / per), per


def read_ranges(splits: int, per: int, length: int) -> tuple[int, int]:
    """(programs, tokens per program) of the kernels that need no reduction over tokens (the read-out, the state's
    backward): the state pass's ranges, cut to at most 2 × :data:`.dispatch.SPLIT_ROUND` tokens (256) once the state
    is split, for as many programs as the GPU takes."""
    if splits == 1:
        return splits, per
    per = min(per, 2 * SPLIT_ROUND)
    return -(-length // per), per


def readout_backward_chunk(block_n: int, block_d: int, tf32_half: bool, before_hopper: bool = False) -> int:
    """BLOCK_N of the read-out's backward: half for TF32 tiles of half inputs (MHLA's: with the last program's sums
    they spill at head dim 64 on sm_90 in 64-token chunks), a quarter before sm_90 (no wgmma: Rᵀ, dR and the tiles
    are all operands in registers, and half spills at head dim 64 on sm_80–sm_89); 16 from head dim 128, where the
    d×d dR accumulator and Rᵀ fill the registers (benchmarks/kernel_resources.py --arch sm_80 --ops "blocked_attention
    mhla")."""
    if tf32_half:
        block_n = max(16, block_n // (4 if before_hopper else 2))
    return 16 if block_d >= 128 else block_n


@lru_cache(maxsize=8)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def is_before_hopper(device: torch.device) -> bool:
    """Whether launches on ``device`` are made for a GPU before sm_90: the dispatch's generation (a cross-build's) or
    the CUDA device's; elsewhere (Triton's interpreter) the sm_90 settings."""
    capability = current().capability
    if capability is None and device.type == "cuda":
        capability = _capability(device)
    return capability is not None and tuple(capability) < HOPPER


def tile_name(dtype: torch.dtype, settings: KernelSettings, bf16_tiles: bool, tf32_matmuls: bool) -> str:
    """The dots' operands: half inputs as TF32 tiles unless ``VITCONVERT_FUSED_TILE=half`` (16-bit), bf16 inputs of
    ``bf16_tiles`` kernels (ELU, ReLU, InLine) as bf16 tiles unless that setting is given; float32 inputs as torch's
    TF32 switch for matmuls says (:func:`.dispatch.tile_args`). bf16 tiles take a third fewer instructions per
    element than TF32's (no conversion to float32 and back for v, q, dO; benchmarks/kernel_instructions.py) and hold
    the tests' bf16 bars against the N×N forms; float16 keeps TF32 (a 4k-token state's sums pass float16's largest
    value)."""
    if dtype == torch.float32:
        return "tf32" if tf32_matmuls else "fp32"
    if settings.tile == "half" or (bf16_tiles and dtype == torch.bfloat16 and not settings.tile_given):
        return HALF_TILES.get(dtype, "tf32")
    return "tf32"


@lru_cache(maxsize=256)
def decide(heads: int, segments: int, chunks: int, head_dim: int, dtype: torch.dtype, programs: int,
           split_round: int, settings: KernelSettings, older: bool, tf32_matmuls: bool,
           bf16_tiles: bool, many_tiles: bool = False, before_hopper: bool = False,
           partial_squares: int = 0, softmax_extra_bytes: int = SOFTMAX_EXTRA_BYTES) -> LinearLaunches:
    """The launches of ``heads`` (batch × heads) × ``segments`` segments of ``chunks`` × ``split_round`` tokens at
    most, for a GPU that wants ``programs`` programs a launch. ``older``: a Triton before 3.8
    (:func:`.dispatch.backward_chunk`); ``many_tiles``: kernels that hold several d×d matrices (TTT's step, which
    takes the chunk, warps and token ranges: :func:`.dispatch.launch_geometry`); ``before_hopper``: a GPU before
    sm_90 (:func:`readout_backward_chunk`); ``partial_squares``: the d×d partial sums a token range writes where
    they outweigh its tokens (TTT's 3: its ranges no shorter than :func:`shortest_range` where the GPU stays
    filled, :func:`bounded_ranges`), their sum kept for backward where it fits what softmax keeps beyond TTT,
    ``softmax_extra_bytes`` a token a head, and :data:`KEPT_SHARE` of q (:func:`keeps_summed`)."""
    length = chunks * split_round
    block_n, block_d, warps = launch_geometry(head_dim, settings.config, many_tiles)
    splits, per = bounded_ranges(heads, segments, length, programs, split_round,
                                 shortest_range(partial_squares, head_dim, dtype, split_round))
    read_splits, read_per = read_ranges(splits, per, length)
    tile = tile_name(dtype, settings, bf16_tiles, tf32_matmuls)
    tf32_half = not bf16_tiles and dtype != torch.float32
    return LinearLaunches(block_n, block_d, warps, settings.stages, tile, splits, per, read_splits, read_per,
                          readout_backward_chunk(block_n, block_d, tf32_half, before_hopper),
                          backward_chunk(block_n, block_d, settings.config is not None, older),
                          splits == 1 and head_dim <= ONE_LAUNCH_BACKWARD_MAX_HEAD_DIM,
                          splits > 1 and keeps_summed(partial_squares, head_dim, dtype, chunks, split_round,
                                                      softmax_extra_bytes))


def linear_launches(t: torch.Tensor, heads: int, segments: int, length: int, bf16_tiles: bool,
                    many_tiles: bool = False, partial_squares: int = 0) -> LinearLaunches:
    """:func:`decide` for a call on ``t`` (q or k) whose segments are ``length`` tokens long, with what the context
    says (:func:`.dispatch.current`): the GPU's programs and generation, the settings, the split round, the Triton,
    the room for kept partials."""
    here = current()
    older = older_triton() if here.older_triton is None else here.older_triton
    tf32_matmuls = t.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return decide(heads, segments, math.ceil(length / here.split_round), t.shape[-1], t.dtype,
                  programs_wanted(t.device), here.split_round, here.settings or environment_settings(), older,
                  tf32_matmuls, bf16_tiles, many_tiles, is_before_hopper(t.device), partial_squares,
                  here.softmax_extra_bytes or SOFTMAX_EXTRA_BYTES)


@dataclass(frozen=True)
class GridLaunches:
    """The grid op's launches (ops/grid: LePE's conv, TTT's key statistics and convs' backward where its step kernels
    do not take them): each program's tokens, head channels and warps."""

    block_m: int
    block_d: int
    warps: int


@lru_cache(maxsize=64)
def decide_grid(head_dim: int, config: Optional[tuple[int, int, int]]) -> GridLaunches:
    """Tiles of :data:`GRID_TILE_ELEMENTS` on 8 warps, or ``config``'s (``VITCONVERT_FUSED_CONFIG=BLOCK_N,num_warps``,
    for sweeps): a pure function of the head dim and the settings, cached, asked by the launches and the plan."""
    block_d = max(16, triton_next_power_of_2(head_dim))
    block, warps = (config or (max(16, GRID_TILE_ELEMENTS // block_d), 8))[:2]
    return GridLaunches(block, block_d, warps)


def grid_launches(head_dim: int) -> GridLaunches:
    """:func:`decide_grid` with the context's settings (:func:`.dispatch.current`)."""
    here = current()
    return decide_grid(head_dim, (here.settings or environment_settings()).config)


@lru_cache(maxsize=8)
def tile_kwargs(tile: str) -> dict:
    """The kernels' TILE, PRECISION and EMULATE arguments of a :class:`LinearLaunches` tile."""
    import triton.language as tl  # lazy: start-up time (triton loads only when a kernel runs)

    operands = {"tf32": tl.float32, "fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}[tile]
    return {"TILE": operands, "PRECISION": "tf32" if tile == "tf32" else "ieee", "EMULATE": interpreting()}


@dataclass(frozen=True)
class PairwiseLaunches:
    """MHLA's pairwise launches (ops/pairwise/op.py), decided once per head dim, dtype, norm and settings: what the
    forward and the backward kernel take instead of deciding it."""

    block_m: int  # the forward's query tile (and key chunk)
    block_d: int
    warps: int  # the forward's
    tile: str  # the forward's dots' operands (:func:`tile_kwargs`)
    backward_block_m: int  # the backward's token tile, each side
    backward_block_n: int  # the chunk the other side is walked in
    backward_warps: int
    backward_tile: str  # 16-bit for half inputs, as autocast's own backward multiplies them


@lru_cache(maxsize=64)
def decide_pairwise(head_dim: int, dtype: torch.dtype, normed: bool, settings: KernelSettings, older: bool,
                    tf32_matmuls: bool) -> PairwiseLaunches:
    """The pairwise launches. With the norm (a forward program per image takes every head, the backward's programs
    their epilogues) twice the warps below head dim 128, where the kernels spill on the forward's; from head dim 128
    the backward on half the tile on 4 warps, where it spills with the forward's tile on any warps; the backward walks
    the other side in half its tile, halved again where an older Triton spills (:func:`.dispatch.backward_chunk`;
    benchmarks/kernel_resources.py --arch sm_90, sm_89 says what each builds)."""
    block, block_d, warps = launch_geometry(head_dim, settings.config)
    doubled = 2 * warps if normed and block_d < 128 else warps
    backward_block, backward_warps = (block // 2, 4) if block_d >= 128 else (block, doubled)
    chunk = backward_chunk(max(16, backward_block // 2), block_d, settings.config is not None, older)
    tile = tile_name(dtype, settings, False, tf32_matmuls)
    return PairwiseLaunches(block, block_d, doubled, tile, backward_block, chunk, backward_warps,
                            HALF_TILES.get(dtype, tile))


def pairwise_launches(t: torch.Tensor, normed: bool) -> PairwiseLaunches:
    """:func:`decide_pairwise` for a call on ``t`` (q) with what the context says (:func:`.dispatch.current`)."""
    here = current()
    older = older_triton() if here.older_triton is None else here.older_triton
    tf32_matmuls = t.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return decide_pairwise(t.shape[-1], t.dtype, normed, here.settings or environment_settings(), older,
                           tf32_matmuls)
