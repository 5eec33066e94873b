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


# -- the same run as markdown, for docs/performance.md (rendered from the saved JSON, never typed) ---------------
DEPTH = {"deit_tiny": 12, "deit_small": 12, "deit_base": 12}  # attention layers: SDPA calls per image
BOUND_FROM_TOKENS = 4097  # below, a batch-16 SDPA call is launch-bound and its time says little of its share


def markdown_report(check: dict[str, Any], commit: str) -> str:
    """docs/performance.md's GPU block from a saved gpu_check JSON: the model-level and one-layer tables, precision
    and cost, captioned with the GPU, the software and the commit whose kernels ran."""
    env = check["env"]
    return "\n\n".join([
        f"One run of `python benchmarks/gpu_check.py --sections {','.join(check['sections'])}` on one {env['gpu']}, "
        f"{env['date'][:10]}, torch {env['torch']}, CUDA {env['cuda']}, timm {env['timm']}, with the kernels of "
        f"commit {commit} (benchmarks/results/gpu-check-cuda.json). bf16 autocast, eager, random weights; speed-up "
        "= softmax's time (timm's fused attention: SDPA) / the student's, in the same run.",
        markdown_speed(check["speed"], check["op"]), markdown_op(check["op"]), markdown_precision(check["precision"]),
        markdown_cost(check["cost"])])


def markdown_speed(speed: list[dict[str, Any]], op: list[dict[str, Any]]) -> str:
    variants = list(dict.fromkeys(r["model"] for r in speed if r["model"] != "softmax"))
    lines = [f"| model, px (tokens), batch | mode | {' | '.join(variants)} | attention-free bound | FLOP bound |",
             "|---|---|" + "---:|" * (len(variants) + 2)]
    for key in dict.fromkeys((r["source"], r["img_size"], r["mode"]) for r in speed):
        rows = {r["model"]: r for r in speed if (r["source"], r["img_size"], r["mode"]) == key}
        base = rows["softmax"]
        sdpa = [o for o in op if o["model"] == "softmax" and o["tokens"] == base["tokens"] and o["mode"] == key[2]]
        bound = "—"
        if sdpa and base["tokens"] >= BOUND_FROM_TOKENS:
            rest = base["ms_per_img"] - DEPTH[key[0]] * sdpa[0]["ms"] / sdpa[0]["batch"]
            bound = f"{base['ms_per_img'] / rest:.2f}×"
        flops = max(r["flop_bound"] for m, r in rows.items() if m != "softmax")
        lines.append(f"| {key[0]}, {key[1]} ({base['tokens']}), {base['batch_size']} | {key[2]} | "
                     + " | ".join(f"{rows[v]['speedup']:.2f}×" for v in variants) + f" | {bound} | {flops:.2f}× |")
    return "\n".join(lines)


def markdown_op(op: list[dict[str, Any]]) -> str:
    variants = list(dict.fromkeys(r["model"] for r in op if r["model"] != "softmax"))
    first = op[0]
    lines = [f"One attention layer, token mixing only (B={first['batch']}, H={first['heads']}, d={first['head_dim']}, "
             "bf16; infer: forward, train: forward and backward):", "",
             f"| N | mode | SDPA ms | {' | '.join(variants)} |", "|---:|---|---:|" + "---:|" * len(variants)]
    for key in dict.fromkeys((r["tokens"], r["mode"]) for r in op):
        rows = {r["model"]: r for r in op if (r["tokens"], r["mode"]) == key}
        lines.append(f"| {key[0]} | {key[1]} | {rows['softmax']['ms']:.3f} | "
                     + " | ".join(f"{rows[v]['speedup']:.2f}×" for v in variants) + " |")
    return "\n".join(lines)


def markdown_precision(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "bf16 against float32: not measured in this run."
    first = rows[0]
    parts = [f"{r['model']} {r['rel_error']:.2e}{'' if r['finite'] else ' (not finite)'}" for r in rows]
    return (f"bf16 against float32 (`forward_features` of {first['source']} at {first['img_size']} px, relative "
            f"error): {', '.join(parts)}.")


def markdown_cost(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "GPU-hours: not measured in this run."
    by_recipe: dict[tuple[str, int], list[str]] = {}
    for c in rows:
        by_recipe.setdefault((c["recipe"], c["epochs"]), []).append(f"{c['model']} {c['gpu_hours']:.1f}")
    return " ".join(f"GPU-hours of {recipe}, {epochs} epochs at the measured img/s (a lower bound: data loading "
                    f"left out): {', '.join(parts)}." for (recipe, epochs), parts in by_recipe.items())
