"""gpu_check's parity section: each variant's training step on the fused kernels against its eager form."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import pair_features
import torch
from gpu_check_plan import Plan

from vitconvert.attention import VARIANTS
from vitconvert.attention.ops import calls, dispatch
from vitconvert.bench import linear_copy
from vitconvert.sources import load_source

PARITY_FP32 = 1e-4  # fused vs eager in float32, TF32 off: the same math summed in another order
PARITY_BF16 = 2.0  # the fused bf16 step's error against the eager float32 one, at most this × the eager bf16 step's
# (rounding noise: over seeds the ratio went up to 1.4× in Triton's interpreter; a wrong kernel is off by O(1))


@contextmanager
def float32_matmuls() -> Iterator[None]:
    """TF32 off for matmuls and convolutions (float32 is then float32 on both paths), restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def training_step(model: torch.nn.Module, x: torch.Tensor, on_kernels: bool,
                  amp: Optional[torch.dtype]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(output, parameter gradients), float32, of one step of ``model`` (train mode) on the fused kernels or not."""
    for m in model.modules():
        if hasattr(m, "fused_kernels"):
            m.fused_kernels = on_kernels
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        out = model(x)
    out.float().square().mean().backward()
    return out.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖."""
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def step_error(got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict]) -> tuple[float, float]:
    """Relative error of the output, and of all parameter gradients as one vector (a parameter whose gradient is
    all but zero, as TTT's convs' at init, has a relative error of rounding noise alone)."""
    names = list(want[1])
    flat = [torch.cat([grads[n].flatten() for n in names]) for grads in (got[1], want[1])]
    return relative_error(got[0], want[0]), relative_error(*flat)


@contextmanager
def mhla_form(form: Optional[str]) -> Iterator[None]:
    """MHLA's kernels in one form inside (``VITCONVERT_MHLA_FORM``'s: pairwise or blocked); None: as dispatch picks
    by cost (fused_pairwise.pairwise_is_cheaper)."""
    if form is None:
        yield
        return
    settings = dataclasses.replace(dispatch.launch_settings(), form=form)
    with dispatch.kernels_on(settings=settings):
        yield


# each variant as dispatch runs it, MHLA in each of its kernels' forms (which one dispatch takes depends on the size)
PARITY_FORMS = (*((name, None) for name in VARIANTS if name != "mhla"), ("mhla", "pairwise"), ("mhla", "blocked"))


def form_label(name: str, form: Optional[str]) -> str:
    return name if form is None else f"{name} ({form})"


def parity(plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    """Per variant: the fused step against the eager one in float32 (where the kernels take float32: not TTT's) and
    in bf16 autocast (against the eager float32 step, next to the eager bf16 step's own error), the kernels' launches
    counted and each op's output checked against its fake. First of all, on a GPU, ELU's and ReLU's φ on bf16 pairs
    (inline PTX, which nothing else runs) against their float32 form over every bf16 value (pair_features.py): a
    value that differs fails that variant's row. On a CPU the kernels run in Triton's interpreter where it is on
    (TRITON_INTERPRET=1, set by this script without a GPU); without it there is nothing to compare."""
    if device.type != "cuda" and not dispatch.interpreting():
        raise RuntimeError("no kernels to check here: no GPU, and TRITON_INTERPRET=1 was not set before triton "
                           "was imported")
    torch.manual_seed(0)  # 2 blocks (the dry run's plan: 1): parity needs no depth, and each launch shape is built once
    width = dict(embed_dim=plan.parity_width[0], num_heads=plan.parity_width[1]) if plan.parity_width else {}
    softmax = load_source(plan.models[0], pretrained=False, img_size=plan.parity_size,
                          depth=plan.depth or 2, **width).model.to(device)
    size = plan.parity_size
    x = torch.randn(plan.parity_batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    launches: list[Any] = []

    def counted(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
        launches.append(kernel)
        dispatch.build_and_run(kernel, grid, *args, **kwargs)

    pairs = pair_features.mismatches(device)
    rows = []
    with dispatch.launches_through(counted, device.type), float32_matmuls():
        for name, form in PARITY_FORMS:
            with mhla_form(form):
                rows.append(parity_row(name, form, softmax, x, plan, launches, pairs.get(name)))
    return rows


def parity_row(name: str, form: Optional[str], softmax: torch.nn.Module, x: torch.Tensor, plan: Plan,
               launches: list[Any], pair_mismatches: Optional[int] = None) -> dict[str, Any]:
    """One variant's parity (``form``: MHLA's kernels forced into it): its fused steps (float32, bf16) against its
    eager ones, the launches counted; ``pair_mismatches``: bf16 values its φ on pairs gets wrong (None: unchecked)."""
    model = linear_copy(softmax, name).to(x.device).train()
    eager32 = training_step(model, x, False, None)
    row: dict[str, Any] = {"model": form_label(name, form), "source": plan.models[0],
                           "img_size": plan.parity_size, "pair_mismatches": pair_mismatches}
    launches.clear()
    fused32 = training_step(model, x, True, None)
    row["fp32_launches"] = len(launches)
    row["fp32_output_error"], row["fp32_grad_error"] = (step_error(fused32, eager32) if launches
                                                        else (None, None))
    launches.clear()
    with calls.fakes_checked() as differ:
        fused16 = training_step(model, x, True, torch.bfloat16)
    row["bf16_launches"], row["fakes_differ"] = len(launches), [repr(d) for d in differ]
    row["bf16_output_error"], row["bf16_grad_error"] = step_error(fused16, eager32)
    row["eager_bf16_output_error"], row["eager_bf16_grad_error"] = step_error(
        training_step(model, x, False, torch.bfloat16), eager32)
    row["verdict"] = parity_verdict(row)
    return row


def parity_verdict(row: dict[str, Any]) -> str:
    """'pass', or what failed: φ on bf16 pairs, no kernels ran, float32 beyond PARITY_FP32, bf16 beyond PARITY_BF16 ×
    eager's (with a floor of 1e-3: both near exact), an op's output unlike its fake."""
    failed = []
    if row.get("pair_mismatches"):
        failed.append(f"φ on bf16 pairs ({row['pair_mismatches']} values)")
    if not row["bf16_launches"]:
        failed.append("no kernels ran")
    if row["fp32_output_error"] is not None and max(row["fp32_output_error"], row["fp32_grad_error"]) > PARITY_FP32:
        failed.append("float32")
    for what in ("output", "grad"):
        if row[f"bf16_{what}_error"] > max(PARITY_BF16 * row[f"eager_bf16_{what}_error"], 1e-3):
            failed.append(f"bf16 {what}")
    if row["fakes_differ"]:
        failed.append("fake")
    return "pass" if not failed else "FAIL: " + ", ".join(failed)
