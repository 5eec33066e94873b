"""``vitconvert list`` (aliases, variants, recipes) and ``vitconvert info FOLDER``."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from ..aliases import ALIASES
from ..attention import VARIANTS
from ..card import hybrid_layers
from ..folder import check_folder, folder_block, read_config, upgrade_notice
from ..loading import LINEAR_FORMS, linear_folder
from ..recipes import available_recipes
from ..timm_registry import source_architecture
from .common import JsonOpt, console, report_table, user_errors

BUNDLED = {"digits": "bundled softmax ViT teacher of the digits data (offline; also --data digits)"}


def options_table() -> Table:
    """Every variant option as its declaration says it (attention/options.py): name, default, what it does."""
    table = Table(title="variant options (--option KEY=VALUE, repeatable; also in a folder's config.json)")
    for column in ("variant", "option", "default", "what it does"):
        table.add_column(column)
    for name, cls in VARIANTS.items():
        for option in cls.declared_options:
            table.add_row(name, option.name, json.dumps(option.default), option.doc)
    return table


@user_errors
def list_cmd(as_json: JsonOpt = False) -> None:
    """Short model aliases, linear-attention variants and training recipes.

    Example: vitconvert list --json
    """

    recipes = available_recipes()
    if as_json:
        variants = {k: dict(v.default_options) for k, v in VARIANTS.items()}
        options = {k: [{"name": o.name, "default": o.default, "doc": o.doc} for o in v.declared_options]
                   for k, v in VARIANTS.items()}
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
        variants.add_row(name, ", ".join(f"{k}={v}" for k, v in cls.default_options.items()), doc)
    console.print(aliases)
    console.print(variants)
    console.print(options_table())
    if recipes:
        console.print("recipes: " + ", ".join(recipes))
    console.print("Any timm model name, hf-hub:org/name\\[@revision], a model folder (PATH or local-dir:PATH) or, for "
                  "convert, a weights file (--arch) is also a SOURCE.")


@user_errors
def info(folder: str = typer.Argument(..., help=LINEAR_FORMS), as_json: JsonOpt = False) -> None:
    """What a converted model is and what was copied.

    Example: vitconvert info ./deit_small_patch16_224-mhla
    """

    path = linear_folder(folder)
    cfg = read_config(path)
    check_folder(path, cfg)  # what load checks, without building the model
    block = folder_block(cfg) or {}  # check_folder passed: ours, or saved by timm from one of ours (implied)
    upgrade = upgrade_notice(path, cfg)
    if as_json:
        typer.echo(json.dumps({"architecture": source_architecture(cfg)[0], "num_classes": cfg.get("num_classes"),
                               **block, "upgrade": upgrade}))
        return
    summary = Table(show_header=False, title=str(folder))
    summary.add_column(style="bold")
    summary.add_column()
    weights = path / "model.safetensors"
    rows = {
        "architecture": source_architecture(cfg)[0],
        "variant": f"{block.get('variant')} {block.get('options') or ''}",
        "source": block.get("source"),
        "classes": cfg.get("num_classes"),
        "init": ", ".join(f"{k}={v}" for k, v in (block.get("init") or {}).items()),
        "attention layers": block.get("replaced"),
        "linear layers": hybrid_layers(block) or "all",
        "weights": f"{weights.stat().st_size / 2**20:.1f} MiB" if weights.exists() else "missing",
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
