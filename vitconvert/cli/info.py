"""``vitconvert list`` (aliases, variants, recipes) and ``vitconvert info FOLDER``."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..top_k import top_k_text
from .common import LINEAR_MODEL_HELP, JsonOpt, console, loading_libraries, plural, report_table, user_errors

if TYPE_CHECKING:
    from ..attention.options import Option

BUNDLED = {"digits": "bundled softmax ViT teacher of the digits data (offline; also --data digits)"}


def applies(option: Option) -> Optional[dict]:
    """When the option does something (``{"feature_map": "hedgehog"}``: only with that value of another), as
    ``list --json`` gives it; None: always."""
    return dict([option.applies]) if option.applies is not None else None


def options_table() -> Table:
    """Every variant option as its declaration says it (attention/options.py): name, default, what it does; an
    option that acts only under another's value says so under its name (plain ELU's ``init_scale``), since the
    variants table above leaves it out."""
    from ..attention import VARIANTS  # lazy: start-up time (and --help's)

    table = Table(title="variant options (--option KEY=VALUE, repeatable; also in a folder's config.json)")
    for column in ("variant", "option", "default", "what it does"):
        table.add_column(column)
    for name, cls in VARIANTS.items():
        for option in cls.declared_options:
            condition = applies(option)
            shown = option.name + (f"\n[dim](only with {pairs(condition)})[/]" if condition else "")
            table.add_row(name, shown, json.dumps(option.default), escape(option.doc))  # a doc's [..] is not markup
    return table


@user_errors
def list_cmd(as_json: JsonOpt = False) -> None:
    """Short model aliases, linear-attention variants and training recipes.

    Example: vitconvert list --json
    """
    with loading_libraries():
        from ..aliases import ALIASES  # lazy: start-up time (and --help's)
        from ..attention import VARIANTS, shown_options  # lazy: start-up time
        from ..recipes import available_recipes  # lazy: start-up time

    recipes = available_recipes()
    if as_json:
        variants = {k: shown_options(k, v.default_options) for k, v in VARIANTS.items()}
        options = {k: [{"name": o.name, "default": o.default, "doc": o.doc, "applies": applies(o)}
                       for o in v.declared_options] for k, v in VARIANTS.items()}
        typer.echo(json.dumps({"aliases": ALIASES, "bundled": BUNDLED, "variants": variants, "options": options,
                               "recipes": recipes}))
        return
    aliases = Table(title="model aliases")
    aliases.add_column("alias")
    aliases.add_column("timm name")
    for alias, name in ALIASES.items():
        aliases.add_row(alias, name)
    for name, what in BUNDLED.items():
        aliases.add_row(name, what)
    variants = Table(title="variants (--to)")
    variants.add_column("name")
    variants.add_column("options (--option KEY=VALUE)")
    variants.add_column("what it is")
    for name, cls in VARIANTS.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        variants.add_row(name, ", ".join(f"{k}={v}" for k, v in shown_options(name, cls.default_options).items()), doc)
    console.print(aliases)
    console.print(variants)
    console.print(options_table())
    if recipes:
        console.print("recipes: " + ", ".join(recipes))
    console.print("Any timm model name, hf-hub:org/name\\[@revision], a model folder (PATH or local-dir:PATH) or, for "
                  "convert, a weights file (--arch) is also a SOURCE.")


RANDOM_SOURCE = " (randomly initialised: converted with --no-pretrained)"
PERCENTS = ("top1", "top5", "best_top1")  # a folder's results hold accuracies in percent, as its model card shows


def pairs(values: dict) -> str:
    """``eps=1e-06, transform=cos``: options and init as a user types them, not as a Python dict."""
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in values.items())


def as_fractions(metrics: dict) -> dict:
    """A folder's results with accuracies as fractions of 1, as every ``--json`` of the CLI gives them."""
    return {k: round(v / 100, 6) if k in PERCENTS and isinstance(v, (int, float)) else v for k, v in metrics.items()}


def results_text(metrics: dict, classes: Any) -> str:
    """``top-1 92.50%, top-5 99.10% on digits (val) after 3 epochs``; a top-5 left unmeasured (null: ``classes`` ≤ 5)
    reads ``n/a (3 classes)``, as eval's table and the model card say it (:mod:`...top_k`)."""
    shown = [(name, metrics[k]) for k, name in (("top1", "top-1"), ("top5", "top-5"))
             if isinstance(metrics.get(k), (int, float)) or (k == "top5" and k in metrics and metrics[k] is None)]
    acc = ", ".join(f"{name} {top_k_text(value, classes, 1.0)}" for name, value in shown)
    where = f" on {metrics['dataset']} ({metrics.get('split', 'val')})" if metrics.get("dataset") else ""
    epochs = metrics.get("epochs")
    return acc + where + (f" after {plural(epochs, 'epoch')}" if isinstance(epochs, int) else "")


GPU_NAMES = "h100, h200, a100, l40, l4, a10, t4, v100"  # (attention/plan.py's GPUS; no torch import for --help)
KernelsOpt = Annotated[bool, typer.Option("--kernels", help="per linear layer, the fused kernels that run on --device "
                                          "and --dtype (or why the eager form does); no GPU needed")]
PlanDeviceOpt = Annotated[str, typer.Option("--device", help="with --kernels: cuda or cpu")]
GpuOpt = Annotated[Optional[str], typer.Option("--gpu", help=f"with --kernels: the GPU planned for ({GPU_NAMES}) "
                                               "[default: this machine's, else h100]")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="with --kernels: q/k/v's dtype (bfloat16 under autocast, "
                                       "float16, float32)")]
BatchOpt = Annotated[int, typer.Option("--batch", help="with --kernels: images a call takes (the token split)")]
DTYPE_NAMES = ("bfloat16", "float16", "float32")


@user_errors
def info(folder: str = typer.Argument(..., help=LINEAR_MODEL_HELP), as_json: JsonOpt = False,
         kernels: KernelsOpt = False, device: PlanDeviceOpt = "cuda", gpu: GpuOpt = None,
         dtype: DtypeOpt = "bfloat16", batch: BatchOpt = 16) -> None:
    """What a converted model is and what was copied.

    Example: vitconvert info ./deit_small_patch16_224-mhla --kernels --gpu h200
    """
    if kernels:
        kernel_plans(folder, as_json, device, gpu, dtype, batch)
        return
    with loading_libraries():
        from ..attention import shown_options  # lazy: start-up time (and --help's)
        from ..card import hybrid_layers  # lazy: start-up time (and --help's)
        from ..folder import check_folder, folder_block, read_config, upgrade_notice, weights_in  # lazy: start-up time
        from ..loading import linear_folder  # lazy: start-up time
        from ..timm_registry import source_architecture  # lazy: start-up time

    path = linear_folder(folder)
    cfg = read_config(path)
    check_folder(path, cfg)  # what load checks, without building the model
    block = folder_block(cfg) or {}  # check_folder passed: ours, or saved by timm from one of ours (implied)
    upgrade = upgrade_notice(path, cfg)
    options = shown_options(block.get("variant"), block.get("options") or {})
    if as_json:  # accuracies as fractions, as eval, distill and compare --json print them
        metrics = block.get("metrics")
        shown = {**block, "metrics": as_fractions(metrics)} if isinstance(metrics, dict) else block
        typer.echo(json.dumps({"architecture": source_architecture(cfg)[0], "num_classes": cfg.get("num_classes"),
                               **shown, "upgrade": upgrade}))
        return
    summary = Table(show_header=False, title=str(folder))
    summary.add_column(style="bold")
    summary.add_column()
    weights = weights_in(path)
    rows = {
        "architecture": source_architecture(cfg)[0],
        "variant": f"{block.get('variant')}" + (f" ({pairs(options)})" if options else ""),
        "source": f"{block.get('source')}{RANDOM_SOURCE if block.get('pretrained') is False else ''}",
        "classes": cfg.get("num_classes"),
        "init": pairs(block.get("init") or {}),
        "attention layers": block.get("depth") or block.get("replaced"),
        "linear layers": hybrid_layers(block) or "all",
        **({"results": results_text(block["metrics"], cfg.get("num_classes"))}
           if isinstance(block.get("metrics"), dict) else {}),
        "weights": f"{weights.stat().st_size / 2**20:.1f} MiB ({weights.name})" if weights.exists() else "missing",
        "written by": ", ".join(f"{k} {v}" for k, v in (block.get("versions") or {}).items()),
    }
    for key, value in rows.items():
        summary.add_row(key, str(value))
    console.print(summary)
    if block.get("groups"):
        console.print(report_table(block, "conversion report"))
    for note in block.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")
    if upgrade:
        console.print(f"[yellow]note:[/] {upgrade}")


def _launch_text(p) -> str:
    """A plan's launch settings in one cell, and what its op keeps for backward where it keeps more than its inputs."""
    stages = plural(p.stages, "stage") if p.stages else "Triton's default stages"
    launch = f"BLOCK_N {p.block_n}, {plural(p.warps, 'warp')}, {stages}, {p.tile} tiles, {plural(p.splits, 'split')}"
    return launch + (f", keeps {', '.join(p.kept)} for backward" if p.kept else "")


def kernel_plans(folder: str, as_json: bool, device: str, gpu: Optional[str], dtype: str, batch: int) -> None:
    """``info --kernels``: attention/plan.py's plan of every linear layer, as a table or JSON."""
    from ..errors import BadValue  # lazy: start-up time (and --help's)

    if device not in ("cuda", "cpu"):
        raise BadValue("device", f"cuda or cpu, got {device!r}")
    if dtype not in DTYPE_NAMES:
        raise BadValue("dtype", f"one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    if batch < 1:
        raise BadValue("batch", f"a positive number of images, got {batch}")
    if gpu is not None and gpu.lower() not in GPU_NAMES.split(", "):  # before torch: a typo answered at once
        raise BadValue("gpu", f"one of {GPU_NAMES}, got {gpu!r}")
    with loading_libraries():
        import torch  # lazy: start-up time

        from ..attention import plan  # lazy: start-up time
        from ..loading import linear_folder, load  # lazy: start-up time

    described = None
    if device == "cuda":
        if gpu is None and torch.cuda.is_available():
            described = plan.local_gpu(torch.device("cuda"))
        else:
            described = plan.GPUS[(gpu or "h100").lower()]
    model = load(str(linear_folder(folder)))
    plans = plan.plan_model(model, described, getattr(torch, dtype), batch)
    where = described.name if described else "the CPU"
    if as_json:
        typer.echo(json.dumps({"device": where, "dtype": dtype, "batch": batch,
                               "layers": [dataclasses.asdict(p) for p in plans]}))
        return
    table = Table(title=f"{folder}: kernels on {where}, {dtype}, batch {batch}")
    # six columns, the launch settings in one: ten cut every name to "atten…" on an 80-column terminal; a narrow
    # one now wraps a cell (at its commas, or inside a long name), never cuts it
    for column in ("layer", "op", "forward", "backward", "launch", "also"):
        table.add_column(column, overflow="fold")
    for p in plans:
        if not p.on_kernels:
            table.add_row(p.layer, f"eager: {p.reason}", *[""] * 4)
            continue
        table.add_row(p.layer, p.op, ", ".join(p.forward), ", ".join(p.backward), _launch_text(p), ", ".join(p.others))
    console.print(table)
    for note in dict.fromkeys(p.note for p in plans if p.note):
        console.print(f"[yellow]note:[/] {note}")
