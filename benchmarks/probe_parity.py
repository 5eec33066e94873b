"""probe_kernels.py's first section: the kernels against the float32 forms, before anything is timed.

ELU's and ReLU's φ on bf16 pairs is inline PTX that has run on no GPU yet (Triton's interpreter runs none), and every
kernel change since the last GPU run was checked in the interpreter only. So on a GPU the probe first compares, over
every bf16 value, φ on pairs with its float32 form (pair_features.py), then each of ELU's, ReLU's and InLine's token
mixing on bf16 q, k, v on the kernels (a head in one program, and heads split over token ranges) with the same mixing
in float32 on its eager form (TF32 off): output and q, k, v gradients, next to the eager bf16 mixing's own error, at
gpu_check's bar (PARITY_BF16). On a CPU the kernels do not run: the rows are the eager forms' (a dry run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pair_features
import torch
from gpu_check_op import token_mixers
from gpu_check_parity import PARITY_BF16, float32_matmuls, relative_error

from vitconvert.attention.ops import dispatch

VARIANTS = ("elu", "relu", "inline")  # (the linear_attention op's; MHLA's and TTT's kernels: gpu_check's parity)
PATHS = {"one launch": 1, "split": 1 << 20}  # programs a launch wants: a head in one program, or heads split


def mixing_step(mix: Callable[..., Any], tensors: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """The output and the q, k, v gradients of ``mix`` on ``tensors`` (q, k, v, do) in ``dtype``, as one float32
    vector of each: (output, gradients)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in tensors[:3])
    out = mix(q, k, v)
    out.backward(tensors[3].to(out.dtype))
    return out.detach().float(), torch.cat([t.grad.float().flatten() for t in (q, k, v)])


def verdict(row: dict[str, Any], on_gpu: bool) -> str:
    """'pass', 'eager (no GPU)' on a CPU, or what failed: no kernels ran, the output or the gradients further from
    float32 than PARITY_BF16 × the eager bf16 mixing's (a floor of 1e-3: both near exact)."""
    if not row["launches"]:
        return "FAIL: no kernels ran" if on_gpu else "eager (no GPU)"
    failed = [what for what in ("output", "grad")
              if row[f"{what}_error"] > max(PARITY_BF16 * row[f"eager_{what}_error"], 1e-3)]
    return "pass" if not failed else "FAIL: " + ", ".join(failed)


def parity(probe: Any, plan: Any) -> None:
    """The section's rows: φ on pairs per feature map, then each variant on each path."""
    values = len(pair_features.every_bf16(torch.device("cpu")))
    for feature, found in pair_features.mismatches(probe.device).items():
        probe.row("parity", check="φ on bf16 pairs", model=feature, values=values, mismatches=found,
                  verdict="no PTX (no GPU)" if found is None else "pass" if found == 0 else f"FAIL: {found} values")
    batch, heads, tokens, d = 2, plan.heads, plan.tile_tokens, plan.head_dim
    g = torch.Generator().manual_seed(0)
    tensors = tuple(torch.randn(batch, heads, tokens, d, generator=g).to(probe.device) for _ in range(4))
    mixers = token_mixers(tokens, heads, d, probe.device)
    launches: list[Any] = []

    def counted(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(kernel)
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    for name in VARIANTS:
        with dispatch.kernels_on(devices=()), float32_matmuls():
            reference = mixing_step(mixers[name], tensors, torch.float32)
            eager = mixing_step(mixers[name], tensors, torch.bfloat16)
        for path, programs in PATHS.items():
            launches.clear()
            with dispatch.kernels_on(launcher=counted, programs=programs):
                fused = mixing_step(mixers[name], tensors, torch.bfloat16)
            row = {"check": "bf16 kernels vs float32", "model": name, "path": path, "tokens": tokens,
                   "launches": len(launches), "output_error": relative_error(fused[0], reference[0]),
                   "grad_error": relative_error(fused[1], reference[1]),
                   "eager_output_error": relative_error(eager[0], reference[0]),
                   "eager_grad_error": relative_error(eager[1], reference[1])}
            probe.row("parity", **row, verdict=verdict(row, probe.device.type == "cuda"))
