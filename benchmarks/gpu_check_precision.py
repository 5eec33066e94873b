"""gpu_check's precision section: bf16-autocast features of each variant against float32 ones."""

from __future__ import annotations

from typing import Any

import torch
from gpu_check_parity import relative_error
from gpu_check_plan import Plan, softmax_source

from vitconvert.attention import VARIANTS
from vitconvert.bench import SOFTMAX, linear_copy


def precision(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    """Relative error of bf16-autocast features against fp32 ones, and whether any is NaN/inf, per model."""
    size = plan.precision_size
    softmax = softmax_source(plan, plan.models[0], size).to(device).eval()
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for name in [SOFTMAX, *VARIANTS]:
        model = softmax if name == SOFTMAX else linear_copy(softmax, name).to(device).eval()
        with torch.inference_mode():
            exact = model.forward_features(x).float()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                half = model.forward_features(x).float()
        finite = bool(torch.isfinite(half).all())
        error = relative_error(half, exact) if finite else float("inf")
        rows.append({"model": name, "source": plan.models[0], "img_size": size, "rel_error": error,
                     "finite": finite})
    return rows
