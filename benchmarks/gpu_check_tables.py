"""gpu_check's report on the terminal: one rich table per section."""

from __future__ import annotations

from typing import Any, Optional

from gpu_check_plan import NOT_MEASURED, Check
from rich.console import Console
from rich.table import Table


def print_tables(check: Check, console: Console) -> None:
    if check.parity:
        console.print(parity_table(check.parity))
    if check.op:
        console.print(op_table(check.op))
    console.print(speed_table(check))
    for p in check.precision:
        console.print(f"bf16 vs fp32 {p['source']} {p['img_size']}px {p['model']}: relative error "
                      f"{p['rel_error']:.2e}, {'finite' if p['finite'] else 'NaN/inf'}")
    if check.distill:
        d = check.distill
        console.print(f"distill: {d['steps']}/{d['expected_steps']} steps, loss {d['first_loss']:.4f} -> "
                      f"{d['last_loss']:.4f}, resumed after '{d['stopped']}': {'ok' if d['ok'] else 'FAILED'}")
    console.print(cost_table(check.cost))
    for line in check.skipped:
        console.print(f"skipped: {line}")
    for line in check.errors:
        console.print(f"[red]error[/]: {line}")


def target_text(target: Optional[float]) -> str:
    return f"≥{target}×" if target else NOT_MEASURED


def parity_table(rows: list[dict[str, Any]]) -> Table:
    def error(value: Optional[float]) -> str:
        return f"{value:.1e}" if value is not None else "-"

    table = Table(title="the fused kernels against the eager forms: a training step's output and gradients, "
                        "relative error (bf16: against the eager float32 step)")
    for column in ("model", "px", "fp32 out", "fp32 grad", "bf16 out", "bf16 grad", "eager bf16 out",
                   "eager bf16 grad", "launches", "verdict"):
        table.add_column(column, justify="left" if column in ("model", "verdict") else "right")
    for r in rows:
        table.add_row(r["model"], str(r["img_size"]), error(r["fp32_output_error"]), error(r["fp32_grad_error"]),
                      error(r["bf16_output_error"]), error(r["bf16_grad_error"]), error(r["eager_bf16_output_error"]),
                      error(r["eager_bf16_grad_error"]), f"{r['fp32_launches']}/{r['bf16_launches']}", r["verdict"])
    return table


def op_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="one attention layer, bf16 autocast: token mixing of (B, H, N, d) q, k, v vs SDPA")
    for column in ("N", "B×H×d", "mode", "model", "ms", "× SDPA", "TFLOP/s", "GB/s", "target", "verdict"):
        table.add_column(column, justify="left" if column in ("mode", "model", "verdict") else "right")
    for r in rows:
        table.add_row(str(r["tokens"]), f"{r['batch']}×{r['heads']}×{r['head_dim']}", r["mode"], r["model"],
                      f"{r['ms']:.3f}", f"{r['speedup']:.2f}" if r["speedup"] else "-", f"{r['tflops']:.1f}",
                      f"{r['gb_s']:.0f}", target_text(r["target"]), r["verdict"])
    return table


def speed_table(check: Check) -> Table:
    env = check.env
    title = f"gpu_check on {env['gpu']} ({env['device']}), torch {env['torch']}, CUDA {env['cuda']}, {env['date']}"
    table = Table(title=title + ("  [DRY RUN: not GPU numbers]" if check.dry_run else ""))
    for column in ("source", "px", "mode", "compile", "fla", "model", "batch", "img/s", "× softmax", "FLOP bound",
                   "peak MB", "target", "verdict", "memory"):
        table.add_column(column, justify="left" if column in ("source", "mode", "model", "verdict") else "right")
    for r in check.speed:
        table.add_row(r["source"], str(r["img_size"]), r["mode"], r["compile"] or "-", "on" if r["fla"] else "-",
                      r["model"], str(r["batch_size"]), f"{r['img_per_s']:.1f}", f"{r['speedup']:.2f}",
                      f"{r['flop_bound']:.2f}", f"{r['peak_mem_mb']:.0f}" if r["peak_mem_mb"] is not None else "-",
                      target_text(r["target"]), r["verdict"], r.get("memory_verdict", NOT_MEASURED))
    return table


def cost_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="GPU-hours of a recipe (teacher forward + student step, measured img/s; a lower bound)")
    for column in ("recipe", "epochs × images", "px", "source", "model", "img/s", "GPU-hours", "≤ softmax"):
        table.add_column(column)
    for c in rows:
        table.add_row(c["recipe"], f"{c['epochs']} × {c['images']:,}", str(c["img_size"]), c["source"], c["model"],
                      f"{c['img_per_s']:.1f}", f"{c['gpu_hours']:.1f}", c.get("verdict", NOT_MEASURED))
    return table
