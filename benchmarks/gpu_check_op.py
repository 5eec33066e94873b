"""gpu_check's op section: one attention layer's token mixing against SDPA, forward and forward+backward."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from gpu_check_parity import form_label, mhla_form
from gpu_check_plan import NOT_MEASURED, Plan

from vitconvert.attention import VARIANTS
from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.pairwise import op as fused_pairwise
from vitconvert.bench import SOFTMAX


def cuda_ms(step: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``step`` (CUDA events on a GPU, the wall clock on a CPU), after two warm-up calls."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def token_mixers(tokens: int, heads: int, head_dim: int, device: torch.device) -> dict[str, Callable[..., Any]]:
    """q, k, v -> o of SDPA and of each variant's ``mix`` (dispatch as in a model: fused kernels where they go)."""
    side = int(round((tokens - 1) ** 0.5))
    grid = (side, side)
    mixers: dict[str, Callable[..., Any]] = {SOFTMAX: lambda q, k, v: F.scaled_dot_product_attention(q, k, v)}
    for name, cls in VARIANTS.items():
        module = cls(heads * head_dim, heads, num_prefix_tokens=1, grid_size=grid).to(device)
        mixers[name] = lambda q, k, v, m=module: m.mix(q, k, v, None, grid)
        if name == "mhla":  # each form of its kernels as well: the rows that tune pairwise_is_cheaper's rule
            segments = module.block_counts[0] * module.block_counts[1] + 1  # (the blocks and the class token's)
            for form in dispatch.FORMS[1:]:
                if form != "pairwise" or segments <= fused_pairwise.MAX_SEGMENTS:  # (above, it runs blocked)
                    mixers[form_label(name, form)] = lambda q, k, v, m=module, f=form: forced(
                        f, m.mix, q, k, v, None, grid)
    return mixers


def forced(form: str, mix: Callable[..., Any], *args: Any) -> Any:
    with mhla_form(form):
        return mix(*args)


def mixer_step(mix: Callable[..., Any], mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               grad: torch.Tensor) -> Callable[[], None]:
    """One forward (no autograd) or forward+backward of ``mix`` under bf16 autocast."""
    autocast = torch.autocast(q.device.type, dtype=torch.bfloat16)
    if mode == "infer":
        def forward() -> None:
            with torch.no_grad(), autocast:
                mix(q, k, v)
        return forward
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def train() -> None:
        with autocast:
            out = mix(*leaves)
        out.backward(grad)
    return train


def op_level(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    """Forward and forward+backward of each token mixer on bf16 q, k, v (B, H, N, d), as autocast hands them over.

    FLOPs: softmax 4·N²·d per head forward (×3.5 with backward), linear 4·N·d² (×3); bytes: q, k, v, o once
    forward (+ o, dO read and dq, dk, dv written backward): what the fastest kernel must move, not what it does.
    """
    batch, heads, d = plan.op_shape
    rows = []
    for tokens in plan.op_tokens:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(batch, heads, tokens, d, generator=g).to(device, torch.bfloat16) for _ in range(3))
        grad = torch.randn(batch, heads, tokens, d, generator=g).to(device, torch.bfloat16)
        elements = batch * heads * tokens * d
        timings: dict[tuple[str, str], float] = {}
        for name, mix in token_mixers(tokens, heads, d, device).items():
            for mode in ("infer", "train"):
                try:
                    timings[name, mode] = cuda_ms(mixer_step(mix, mode, q, k, v, grad), device, plan.op_repeats)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    continue
                quadratic = name in (SOFTMAX, form_label("mhla", "pairwise"))
                flops = (4 * tokens * tokens * d if quadratic else 4 * tokens * d * d) * batch * heads
                flops *= 1.0 if mode == "infer" else (3.5 if quadratic else 3.0)
                moved = elements * 2 * (4 if mode == "infer" else 12)
                ms = timings[name, mode]
                softmax_ms = timings.get((SOFTMAX, mode))
                speedup = softmax_ms / ms if softmax_ms else None
                target = plan.op_targets.get(tokens, {}).get(mode) if name != SOFTMAX else None
                judged = NOT_MEASURED if target is None or speedup is None else (
                    "dry run" if device.type != "cuda" else ("pass" if speedup >= target else "FAIL"))
                rows.append({"tokens": tokens, "batch": batch, "heads": heads, "head_dim": d, "mode": mode,
                             "model": name, "ms": ms, "speedup": speedup, "tflops": flops / ms / 1e9,
                             "gb_s": moved / ms / 1e6, "target": target, "verdict": judged})
        del q, k, v, grad
    return rows
