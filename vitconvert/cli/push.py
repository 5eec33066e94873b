"""``vitconvert push FOLDER --repo org/name``: a model or run folder -> a complete Hugging Face Hub repo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .common import JsonOpt, console, loading_libraries, user_errors


def human_size(n: int) -> str:
    """A byte count as people read file sizes (decimal units: kB, MB, GB)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"


def files_table(files: list[tuple[str, int]], title: str) -> Table:
    """What a push would upload (or did), file by file, with the total: a dry run's whole answer."""
    table = Table(title=title)
    table.add_column("file")
    table.add_column("size", justify="right")
    for name, size in files:
        table.add_row(name, human_size(size))
    table.add_section()
    table.add_row(f"{len(files)} files", human_size(sum(size for _, size in files)))
    return table


@user_errors
def push(
    folder: Path = typer.Argument(..., help="a vitconvert model folder or distill run folder"),
    repo: str = typer.Option(..., "--repo", help="Hub repo id, org/name (created if missing)"),
    private: bool = typer.Option(False, "--private", help="create the repo private (an existing repo keeps its "
                                                          "visibility)"),
    revision: Optional[str] = typer.Option(None, "--revision", help="branch to commit to (created if missing) "
                                                                    "[default: main]"),
    commit_message: Optional[str] = typer.Option(None, "--commit-message", help="commit message"),
    token: Optional[str] = typer.Option(None, "--token", help="Hub token [default: HF_TOKEN, then the cached login]",
                                        show_default=False),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate, refresh the card, list the files; send nothing"),
    as_json: JsonOpt = False,
) -> None:
    """Validate the folder, refresh its model card and upload it to the Hub in one commit.

    Example: vitconvert push runs/deit_small_patch16_224-mhla-cifar100 --repo me/deit-small-mhla --dry-run
    """
    with loading_libraries():
        from ..hub import push_folder  # lazy: start-up time (and --help's)

    plan = push_folder(folder, repo, private=private, revision=revision, commit_message=commit_message, token=token,
                       dry_run=dry_run)
    if as_json:
        typer.echo(json.dumps(plan.to_dict()))
        return
    where = f"{plan.repo_id}" + (f"@{plan.revision}" if plan.revision else "")
    console.print(files_table(plan.files, f"{'would upload' if dry_run else 'uploaded'} to {where}"))
    refreshed = "refreshed from config.json" + (" when pushed (a dry run writes nothing)" if dry_run else "")
    console.print(f"README.md: {refreshed if plan.card == 'refreshed' else 'kept (your own card)'}")
    if plan.skipped:
        console.print("not uploaded: " + ", ".join(plan.skipped))
    if plan.shown_by_name:  # the folder keeps them (compare and distill find the teacher by them); the Hub does not
        console.print("local paths sent by name only: " + ", ".join(f"{path} -> {name}" for path, name in
                                                                    sorted(plan.shown_by_name.items())), soft_wrap=True)
    if dry_run:
        login = f"token from {plan.token_source}" if plan.token_source else "[yellow]no token yet[/]: hf auth login"
        console.print(f"[green]dry run[/]: nothing was sent ({login}); drop --dry-run to push to {plan.url}")
    else:
        console.print(f"[green]pushed[/] {plan.url}" + (f" ({plan.commit_url})" if plan.commit_url else ""))
