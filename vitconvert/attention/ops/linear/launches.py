"""The two building blocks of the fused ops (:mod:`.op`): the launches of the per-segment states and of the
read-out, each way.

:func:`segment_states`  (k, v) -> per-segment S, z, zv        (float32, d×d per head and segment)
:func:`run_readout`     (q, R, r) -> o                        (q's dtype, laid out as (B, N, H, d))

They are not ops of their own: ``vitconvert::linear_attention`` and ``vitconvert::blocked_attention`` call them, and
their eager forms are :func:`.eager.state` and :func:`.eager.readout`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..dispatch import interpreting, launch, triton_next_power_of_2
from ..launch_plan import linear_launches, tile_kwargs
from ..layout import Lepe, _mask_arg, _output_like, unit_rows


class OnGrid(NamedTuple):
    """MHLA's LePE as the blocked op's read-out and state backward take it: v, the key mask, the filters
    (:func:`..layout.lepe_args`), whether a bias is given, and the rows × cols grid after ``prefix`` tokens."""

    v: torch.Tensor
    key_valid: Optional[torch.Tensor]
    lepe: Lepe
    has_bias: bool
    rows: int
    cols: int
    prefix: int


Norm = tuple[torch.Tensor, torch.Tensor]  # MHLA's RMSNorm applied as tiles load: ((B, N) 1/rms, (H·d,) weights as
# they are: the kernels read them in their dtype, unpadded)


def rstd_rows(q: torch.Tensor, q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor]) -> torch.Tensor:
    """What the forward keeps for backward besides q, k, v: (2, B, N) float32, each token's 1/rms over all heads of q
    and of k (filled by the forward's kernels as they take it: the blocked form's read-out and state kernels,
    :mod:`.norm_parts`, or the pairwise forward kernel); an empty tensor without the norm."""
    if q_weight is None or k_weight is None:
        return q.new_empty((0,), dtype=torch.float32)
    return q.new_empty((2, q.shape[0], q.shape[2]), dtype=torch.float32)


def norm_pair(q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
              rstd: torch.Tensor) -> tuple[Optional[Norm], Optional[Norm]]:
    """q's and k's RMSNorm over heads as the kernels apply it: each token's 1/rms in ``rstd`` (:func:`rstd_rows`)
    and the weights as they are (the kernels read them in their dtype, masked past the last head); (None, None)
    without both weights."""
    if q_weight is None or k_weight is None:
        return None, None
    return (rstd[0], q_weight.contiguous()), (rstd[1], k_weight.contiguous())


def norm_launch_args(norm: Optional[Norm], unread: torch.Tensor, B: int, H: int, D: int, ranges: int,
                     used: int) -> tuple:
    """(RSTD, NW, DNW, NCOUNTER, NWG) of a backward kernel that takes MHLA's RMSNorm (:mod:`.norm_parts`): the norm,
    the weight gradient's rows (one per token range of an image, then one per image: H·D float32 each), a ticket per
    range and B + 1 for the batch's sum (after the ``used`` ones of the launch's other tickets), and the weight's
    gradient (its dtype), summed over the batch by the kernel; placeholders (``unread``) without the norm."""
    if norm is None:
        return (unread,) * 5
    rows = unread.new_empty((B * ranges + B, H * D), dtype=torch.float32)
    count = B * ranges + B + 1
    return (*norm, rows, tickets(used + count, unread.device)[used:used + count], torch.empty_like(norm[1]))


def block_g(segments: int) -> int:
    """W̃'s side padded to the mixing's float32 dots (:mod:`.mixing_parts`) and the pairwise backward's one-hot
    dots that sum dW̃ (ops/pairwise/kernels.py)."""
    return max(16, triton_next_power_of_2(segments))


def mix_chunk(head_dim: int) -> int:
    """MIX_CHUNK, the columns of the D·D + D of a segment's state row that the last program mixes at a time
    (:mod:`.mixing_parts`): 128 on a GPU (registers); in Triton's interpreter, where a step costs about the same
    whatever its width, half a row rounded up to a power of two (two steps: the loop and the tail's mask still run)."""
    return max(128, triton_next_power_of_2(-(-(head_dim * head_dim + head_dim) // 2))) if interpreting() else 128


def _table(mixing: Optional[torch.Tensor], like: torch.Tensor, segments: int) -> tuple[torch.Tensor, int]:
    """(W̃ as the kernels read it, in its dtype and contiguous (a parameter already is), its side): G × G over the
    ``segments``, or (G − 1) × (G − 1) with the last segment's row and column ones, made as the kernels load it
    (:mod:`.mixing_parts`: MHLA's W̃ of its blocks and the class token's, so its module pads nothing); ``like``
    (never read) without one."""
    if mixing is None:
        return like, segments
    side = mixing.shape[0]
    if mixing.shape != (side, side) or side not in (segments, segments - 1):
        raise ValueError(f"W̃ of shape {tuple(mixing.shape)} for {segments} segments: it must be {segments}×{segments} "
                         f"or {segments - 1}×{segments - 1}")
    return mixing.contiguous(), side


def square_dtype(t: torch.Tensor, mixing: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype of the d×d squares MHLA's kernels hand on, R to the read-out and dS to the state's backward: bf16
    where its inputs are bf16 (the largest tensors the blocked op moves, halved; the read-out's and the state
    backward's dots take them as they take q or do; within the bf16 bars: tests/attention/test_fused.py), else float32
    (float16's range is too small for a long sequence's sums, and without W̃ the kernels keep float32 throughout)."""
    return torch.bfloat16 if mixing is not None and t.dtype == torch.bfloat16 else torch.float32


def _segments(index: Optional[torch.Tensor], tokens: int) -> tuple[int, int]:
    """(segments, columns of the index table): one segment of every token without a table."""
    return (1, tokens) if index is None else (index.shape[0], index.shape[1])


def _unmasked_chunks(head_dim: int, block_d: int) -> bool:
    """EVEN_D of the backward kernels: whole chunks without masks where the head fills its tile, up to 64 (what the
    unmasked code builds to at 128 for sm_90: benchmarks/kernel_resources.py --arch sm_90)."""
    return head_dim == block_d <= 64


# -- the ops -------------------------------------------------------------------------------------------------
def segment_states(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                   index: Optional[torch.Tensor], feature: int, feature_eps: float,
                   sum_values: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """S (B, H, G, d, d), z and zv (B, H, G, d), float32, over the G segments of ``index`` (all tokens if None);
    zv None unless ``sum_values`` (InLine reads it, the others do not: the kernel leaves its sums out). One launch:
    the token ranges' partial states are summed by the kernel's last program (ops/linear/split_kernels.py)."""
    S, z, zv, _, _ = _states(k, v, key_valid, index, feature, feature_eps, sum_values, None)
    return S, z, zv


def mixed_states(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], index: Optional[torch.Tensor],
                 mixing: torch.Tensor, feature: int, feature_eps: float, keep: bool,
                 norm: Optional[Norm] = None, take_rstd: Optional[float] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R, r, states) of MHLA's blocked form in one launch: R_a = Σ_s W̃[a, s] S_s and r_a = Σ_s W̃[a, s] z_s (B, H, G,
    d, d) and (B, H, G, d) float32, mixed by the state kernel's last program of each batch·head; ``states``: the
    kernel's partial rows, where with ``keep`` each segment's first holds its unmixed [S_s | z_s] (the backward's
    :func:`readout_gradients` reads them for dW̃); ``norm``: k gets MHLA's RMSNorm as it loads (:data:`Norm`), each
    key's 1/rms read from its first, or with ``take_rstd`` (the norm's ε) taken by the kernel over every head and
    stored there."""
    R, r, _, _, part = _states(k, v, key_valid, index, feature, feature_eps, False, None, mixing=mixing, keep=keep,
                               norm=norm, take_rstd=take_rstd)
    return R, r, part


def readers(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], feature: int, feature_eps: float,
            scale: float, inline: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R, r, z, n) of every head in one launch, what its queries read: kernel attention R = S and r = z; InLine
    R = (s/n)(S − z v̄ᵀ) and r = v̄ = zv/n, n (B·H,) the valid keys (z and n: for its backward's chain rule)."""
    return _states(k, v, key_valid, None, feature, feature_eps, inline, scale if inline else None, True)[:4]


def _states(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], index: Optional[torch.Tensor],
            feature: int, feature_eps: float, sum_values: bool, inline_scale: Optional[float],
            bf16_tiles: bool = False, mixing: Optional[torch.Tensor] = None, keep: bool = False,
            norm: Optional[Norm] = None, take_rstd: Optional[float] = None):
    """The state kernel's launch (:func:`segment_states`, :func:`readers`, :func:`mixed_states`): (R, r, aux, n,
    partial rows), aux zv or (InLine) z; with ``mixing`` R and r mixed by it, a ticket per batch·head."""
    from .split_kernels import state_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    k, v = unit_rows(k), unit_rows(v)
    B, H, N, D = k.shape
    segments, length = _segments(index, N)
    plan = linear_launches(k, B * H, segments, length, bf16_tiles)
    splits, per, block_n, block_d, warps = plan.splits, plan.per, plan.block_n, plan.block_d, plan.warps
    part = k.new_empty((B * H * segments * splits, D * D + 2 * D + 1), dtype=torch.float32)
    R = k.new_empty((B, H, segments, D, D), dtype=square_dtype(k, mixing))
    r = k.new_empty((B, H, segments, D), dtype=torch.float32)
    aux = torch.empty_like(r) if sum_values else None
    n = k.new_empty((B * H * segments,), dtype=torch.float32) if inline_scale is not None else None
    mask, s_mb = _mask_arg(key_valid, k)
    table, side = _table(mixing, k, segments)
    launch(state_fwd_kernel, (B * H, segments, splits),
        k, v, mask, index if index is not None else k, part, tickets(B * H * segments, k.device), R, r,
        r if aux is None else aux, r if n is None else n, table, *(norm or (r, r)),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), s_mb, N,
        H, length, D, segments, splits, per, feature_eps, inline_scale or 1.0, int(keep), side, take_rstd or 0.0,
        FEATURE=feature, HAS_MASK=key_valid is not None, HAS_INDEX=index is not None, INLINE=inline_scale is not None,
        SUM_V=sum_values, MIX=mixing is not None, EVEN_D=D == block_d, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_G=block_g(segments), MIX_CHUNK=mix_chunk(D), NORM=norm is not None,
        TAKE_RSTD=norm is not None and take_rstd is not None, **tile_kwargs(plan.tile),
        num_warps=warps, num_stages=plan.stages)
    return R, r, aux, n, part


_tickets: dict[torch.device, torch.Tensor] = {}  # device -> the split kernels' int32 tickets, zero between launches


def tickets(count: int, device: torch.device) -> torch.Tensor:
    """At least ``count`` int32 counters at zero, one per (batch·head, segment) of a split kernel: the last program
    of each segment puts its counter back to zero (split_kernels.py), so they are made once per device and reused by
    every launch (no fill between launches). They grow geometrically, to the power of two at or above twice what a
    launch asks (at least 4096): a training step's backward asks more than its forward (the norm's and W̃'s
    tickets besides the segments'), but under twice as many where each head is one token range and there are two
    heads or more (as wherever the count passes 4096 on a GPU), so a new shape allocates once in its first step,
    and steady-state steps allocate nothing. Launches on one stream take turns; two streams running these kernels at
    once would share them."""
    found = _tickets.get(device)
    if found is None or found.numel() < count:
        found = _tickets[device] = torch.zeros(max(1 << (2 * count - 1).bit_length(), 4096), dtype=torch.int32,
                                               device=device)
    return found


def state_gradients(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                    index: Optional[torch.Tensor], dS: torch.Tensor, dz: torch.Tensor, dzv: Optional[torch.Tensor],
                    feature: int, feature_eps: float, bf16_tiles: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """dk, dv (the dtypes and shapes of k and v, laid out as the output: :func:`_output_like`) from the gradients
    of S, z, zv (None: zero, as for every variant but InLine: no torch op makes the zeros, the kernel adds none)."""
    dk, dv, _, _ = lepe_state_gradients(k, v, key_valid, index, dS, dz, dzv, feature, feature_eps, bf16_tiles)
    return dk, dv


def lepe_state_gradients(k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
                         index: Optional[torch.Tensor], dS: torch.Tensor, dz: torch.Tensor, dzv: Optional[torch.Tensor],
                         feature: int, feature_eps: float, bf16_tiles: bool = False, on_grid: Optional[OnGrid] = None,
                         do: Optional[torch.Tensor] = None, norm: Optional[Norm] = None
                         ) -> tuple[torch.Tensor, torch.Tensor, tuple, Optional[torch.Tensor]]:
    """:func:`state_gradients`, and with ``on_grid`` (an index table, and ``do``) LePE's backward in the same launch:
    dv gets its taps of do, and (dweight (H·d, KS·KS), dbias (H·d)) in the weight's dtype, each batch·head's summed
    from its chunks' rows by its last program and those over the batch by the last of all (else an empty tuple); with
    ``norm`` k gets MHLA's RMSNorm as it loads and its backward, as :func:`readout_gradients` q's, and dnorm_weight
    (else None)."""
    from .split_kernels import state_bwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    k, v = unit_rows(k), unit_rows(v)
    B, H, N, D = k.shape
    segments, length = _segments(index, N)
    plan = linear_launches(k, B * H, segments, length, bf16_tiles)
    splits, per, block_n, block_d, warps = plan.read_splits, plan.read_per, plan.block_n, plan.block_d, plan.warps
    dk, dv = _output_like(k), _output_like(v)
    mask, s_mb = _mask_arg(key_valid, k)
    dz = dz.contiguous()
    lepe = on_grid is not None and on_grid.lepe.on
    size = on_grid.lepe.size if lepe else 1
    chunks = -(-min(per, length) // block_n)  # (a range's chunks: each stores a row of LePE's filter gradient)
    if lepe:
        do = unit_rows(do)
        part = k.new_empty((B * H * segments * splits * chunks, (size * size + 1) * D), dtype=torch.float32)
        rows = k.new_empty((B * H, D, size * size), dtype=torch.float32), k.new_empty((B * H, D), dtype=torch.float32)
        filters, grid = on_grid.lepe.filters, (on_grid.prefix, on_grid.rows, on_grid.cols)
        dweight = k.new_empty((H * D, size * size), dtype=filters.dtype)  # (no cast after: the kernel stores them so)
        dbias = k.new_empty((H * D,), dtype=filters.dtype)
    else:
        do = part = dweight = dbias = filters = dz
        rows, grid = (dz, dz), (0, 0, 0)
    norm_args = norm_launch_args(norm, dz, B, H, D, segments * splits, B * H + 1)
    launch(state_bwd_kernel, (B * H, segments, splits),
        k, v, mask, index if index is not None else k, dS.contiguous(), dz, dz if dzv is None else dzv.contiguous(),
        dk, dv, do, filters, part, tickets(B * H + 1, k.device), *rows, dweight, dbias, *norm_args,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), s_mb,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        *(do.stride()[:3] if lepe else (0, 0, 0)), N,
        H, length, D, segments, splits, chunks, per, feature_eps, *grid,
        FEATURE=feature, HAS_MASK=key_valid is not None, HAS_INDEX=index is not None, HAS_DZV=dzv is not None,
        LEPE=lepe, KS=size, EVEN_D=_unmasked_chunks(D, block_d), BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_T=max(16, triton_next_power_of_2(size * size + 1)) if lepe else 16, NORM=norm is not None,
        BLOCK_H=triton_next_power_of_2(H), **tile_kwargs(plan.tile), num_warps=warps, num_stages=plan.stages)
    return dk, dv, ((dweight, dbias) if lepe else ()), (None if norm is None else norm_args[4])


def run_readout(q: torch.Tensor, R: torch.Tensor, r: torch.Tensor, index: Optional[torch.Tensor], feature: int,
                   feature_eps: float, eps: float, normalise: bool) -> torch.Tensor:
    """o of every query from the state R (B, H, G, d, d) and r (B, H, G, d) of its segment (module docstring)."""
    return read_out(q, R, r, index, feature, feature_eps, eps, normalise)


def read_out(q: torch.Tensor, R: torch.Tensor, r: torch.Tensor, index: Optional[torch.Tensor], feature: int,
             feature_eps: float, eps: float, normalise: bool, bf16_tiles: bool = False,
             on_grid: Optional[OnGrid] = None, norm: Optional[Norm] = None, norm_eps: float = 0.0) -> torch.Tensor:
    """:func:`run_readout`; ``bf16_tiles``: bf16 inputs on bf16 tiles (:func:`..launch_plan.tile_name`); ``on_grid``
    (with an index table): o + LePE, added in the same launch; ``norm``: q gets MHLA's RMSNorm (ε ``norm_eps``) as it
    loads, each query's 1/rms taken by the kernel over every head and stored in the norm's first."""
    from .split_kernels import readout_fwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    q = unit_rows(q)
    B, H, N, D = q.shape
    segments, length = _segments(index, N)
    plan = linear_launches(q, B * H, segments, length, bf16_tiles)
    splits, per, block_n, block_d, warps = plan.read_splits, plan.read_per, plan.block_n, plan.block_d, plan.warps
    o = _output_like(q)
    lepe = on_grid is not None and on_grid.lepe.on
    v = unit_rows(on_grid.v) if lepe else q
    mask, s_mb = _mask_arg(on_grid.key_valid if lepe else None, q)
    filters, bias = (on_grid.lepe.filters, on_grid.lepe.bias) if lepe else (q, q)
    launch(readout_fwd_kernel, (B * H, segments, splits),
        q, R.contiguous(), r.contiguous(), o, index if index is not None else q, v, mask, filters, bias,
        *(norm or (q, q)), q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2), v.stride(0),
        v.stride(1), v.stride(2), s_mb, N, H, length, D, segments, per, feature_eps, eps,
        *((on_grid.prefix, on_grid.rows, on_grid.cols) if lepe else (0, 0, 0)), norm_eps,
        FEATURE=feature, NORMALISE=normalise, HAS_INDEX=index is not None, EVEN_D=D == block_d, LEPE=lepe,
        KS=on_grid.lepe.size if lepe else 1, HAS_LBIAS=lepe and on_grid.has_bias, HAS_MASK=mask is not q,
        NORM=norm is not None,
        BLOCK_N=block_n, BLOCK_D=block_d, **tile_kwargs(plan.tile), num_warps=warps, num_stages=plan.stages)
    return o


def run_readout_backward(q: torch.Tensor, R: torch.Tensor, r: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                            index: Optional[torch.Tensor], feature: int, feature_eps: float, eps: float,
                            normalise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (q's dtype and :func:`_output_like`'s layout), dR and dr (float32) of :func:`run_readout`."""
    dq, dR, dr, _, _, _ = readout_gradients(q, R, r, o, do, index, feature, feature_eps, eps, normalise, None)
    return dq, dR, dr


def readout_gradients(q: torch.Tensor, R: torch.Tensor, r: torch.Tensor, o: Optional[torch.Tensor], do: torch.Tensor,
                      index: Optional[torch.Tensor], feature: int, feature_eps: float, eps: float, normalise: bool,
                      inline: Optional[tuple[torch.Tensor, torch.Tensor, float]], bf16_tiles: bool = False,
                      mixing: Optional[tuple[torch.Tensor, torch.Tensor]] = None, norm: Optional[Norm] = None):
    """(dq, dS, dz, dzv, dW̃, dnorm_weight) in one launch, the partial sums over token ranges summed by the kernel's
    last program: dS = dR, dz = dr and dzv None, or with ``inline`` = (z, n, scale) from :func:`readers`, InLine's
    chain rule through R = (s/n)(S − z v̄ᵀ) and v̄ = zv/n (ops/linear/split_kernels.py); with ``mixing`` = (W̃, the
    states of :func:`mixed_states` with keep), MHLA's: dS_s = Σ_a W̃[a, s] dR_a and dW̃ (G, G), summed over every
    batch·head (else None). ``o`` None (normalised only): do·o from the kernel's dot of do and R (o is not read).
    ``norm`` (:data:`Norm`): q gets MHLA's RMSNorm as it loads, and its backward (dq the raw q's, by the last program
    of each token range's heads: :mod:`.norm_parts`), and dnorm_weight (else None). dW̃ and dnorm_weight come summed
    over the batch by the kernel's last programs, in the weights' dtypes (:func:`.tickets.batch_total`)."""
    from .split_kernels import readout_bwd_kernel  # lazy: start-up time (triton loads only when a kernel runs)

    q, do = unit_rows(q), unit_rows(do)
    o = q if o is None else unit_rows(o)
    B, H, N, D = q.shape
    segments, length = _segments(index, N)
    plan = linear_launches(q, B * H, segments, length, bf16_tiles)
    splits, per, block_n, block_d, warps = plan.splits, plan.per, plan.readout_bwd_block_n, plan.block_d, plan.warps
    dq = _output_like(q)
    part = q.new_empty((B * H * segments * splits, D * D + D), dtype=torch.float32)
    dS = q.new_empty((B, H, segments, D, D), dtype=square_dtype(q, None if mixing is None else mixing[0]))
    dz = q.new_empty((B, H, segments, D), dtype=torch.float32)
    dzv = torch.empty_like(dz) if inline is not None else None
    z, n, scale = inline if inline is not None else (dz, dz, 1.0)
    table, side = _table(None if mixing is None else mixing[0], dz, segments)
    states = mixing[1] if mixing is not None else dz
    mixing_rows = q.new_empty((B * H + B, side * side), dtype=torch.float32) if mixing is not None else dz
    dmixing = torch.empty_like(mixing[0]) if mixing is not None else None  # (W̃'s dtype: the kernel sums the rows)
    used = B * H * segments + B + 1  # (a ticket per segment, or with W̃ per batch·head, and B + 1 for dW̃'s sum)
    norm_args = norm_launch_args(norm, dz, B, H, D, segments * splits, used)
    launch(readout_bwd_kernel, (B * H, segments, splits),
        q, R.contiguous(), r.contiguous(), o, do, dq, part, tickets(used, q.device), z, n, dS, dz,
        dz if dzv is None else dzv, index if index is not None else q, states, table, mixing_rows,
        dz if dmixing is None else dmixing, *norm_args,
        q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2), dq.stride(0), dq.stride(1), dq.stride(2), N,
        H, length, D, segments, splits, per, feature_eps, eps, scale, side,
        FEATURE=feature, NORMALISE=normalise, INLINE=inline is not None, HAS_INDEX=index is not None,
        HAS_O=o is not q, MIX=mixing is not None, EVEN_D=_unmasked_chunks(D, block_d), BLOCK_N=block_n,
        BLOCK_D=block_d, BLOCK_G=block_g(segments), MIX_CHUNK=mix_chunk(D), NORM=norm is not None,
        BLOCK_H=triton_next_power_of_2(H), **tile_kwargs(plan.tile), num_warps=warps, num_stages=plan.stages)
    return dq, dS, dz, dzv, dmixing, (None if norm is None else norm_args[4])
