"""Push a model or run folder to the Hugging Face Hub as a complete repo: weights, config, card, recipe.

The folder is validated (it must load) and its card refreshed before anything is sent; the upload is one
``upload_folder`` call, which also deletes the remote files an earlier push left that this folder does not send.
The token is passed to huggingface_hub and nowhere else: never printed, logged or written.
"""

from __future__ import annotations

import glob
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .card import CARD_MARKER, render_card
from .errors import BadValue, VitconvertError, first_line, param
from .folder import WEIGHTS, folder_block, load_folder_model, read_config, weights_in
from .hub_io import check_endpoint, describe_hub_error, hub_offline, parse_repo_id, resolve_token, token_source
from .public_names import local_paths, public, shown_path
from .timm_registry import source_architecture
from .version import __version__
from .writer import write_text_atomic

MODEL_FILES = ("config.json", "model.safetensors", "README.md")
RUN_FILES = ("recipe.yaml", "metrics.jsonl")  # present in a distill run folder
EXTRA_PATTERNS = ("*.png",)  # training curves, top level only
# Never sent even if a pattern above should ever match them: resumable state is large and private.
NEVER = ["checkpoint-*", "checkpoint-*/**", "best/**", "*.pt", "*.pth", "*.bin", "optimizer*", ".*"]
# Every remote file the upload does not send is deleted in the same commit, so the repo (that revision) holds this
# folder's files only, not a mix with an earlier push's (huggingface_hub always keeps .gitattributes).
REPLACE_REMOTE = ["*"]


@dataclass
class PushPlan:
    """What a push sends (or, with dry_run, would send)."""

    folder: str
    repo_id: str
    revision: Optional[str]
    files: list[tuple[str, int]]  # (name in repo, bytes)
    skipped: list[str]  # top-level entries of the folder that are not sent
    card: str  # "refreshed" or "kept" (a hand-written README.md without our marker)
    dry_run: bool
    url: str = ""
    commit_url: Optional[str] = None
    token_source: Optional[str] = None  # where a token would come from; never the token itself
    shown_by_name: dict[str, str] = field(default_factory=dict)  # a local path -> what the sent files say instead

    def to_dict(self) -> dict[str, Any]:
        """The plan as ``push --json`` prints it."""
        return asdict(self)


def check_folder(folder: Path) -> dict[str, Any]:
    """config.json with a "vitconvert" block and weights that load strictly into it: what a user could use."""
    if not folder.is_dir():
        raise VitconvertError(f"folder not found: {folder}")
    config = read_config(folder)
    if "vitconvert" not in config and folder_block(config) is not None:
        raise VitconvertError(f"{folder} was saved by timm's own saver from a vitconvert model: `vitconvert upgrade "
                              f"{folder}` makes it a full vitconvert folder (which transformers loads too), then push "
                              "it")
    if "vitconvert" not in config:
        raise VitconvertError(f"{folder} is not a vitconvert folder (its config.json has no 'vitconvert' block); "
                              "convert it first with `vitconvert convert`")
    load_folder_model(folder, config)
    if (pickle := weights_in(folder)).name != WEIGHTS:  # the Hub gets safetensors only (NEVER: *.bin)
        raise VitconvertError(f"{folder} holds its weights as torch's pickle {pickle.name}, which push leaves out: "
                              f"`vitconvert upgrade {folder}` writes them as {WEIGHTS}, then push it")
    return config


def card_config(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """config.json as the card sees it: a run folder's recipe.yaml fills in a recipe the block lacks."""
    block = dict(config.get("vitconvert") or {})
    recipe_file = folder / "recipe.yaml"
    if not block.get("recipe") and recipe_file.is_file():
        try:
            recipe = yaml.safe_load(recipe_file.read_text())
        except yaml.YAMLError as e:
            raise VitconvertError(f"{recipe_file} is not valid YAML ({first_line(e)})") from None
        if isinstance(recipe, dict):
            block["recipe"] = recipe
    return {**config, "vitconvert": block}


def refresh_card(folder: Path, config: dict[str, Any], repo_id: Optional[str], write: bool = True) -> tuple[str, str]:
    """("refreshed" or "kept", the card's text): README.md re-rendered unless the user wrote their own (no marker),
    written only with ``write`` (a dry run changes nothing); either way its metadata must parse."""
    from huggingface_hub import ModelCard

    readme = folder / "README.md"
    text = readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else ""
    if readme.is_file() and CARD_MARKER not in text:
        action = "kept"
    else:
        text, action = render_card(card_config(folder, config), repo_id=repo_id), "refreshed"
        if write:
            write_text_atomic(readme, text)
    try:
        ModelCard(text)
    except Exception as e:  # the Hub would refuse the commit for the same reason
        raise VitconvertError(f"{readme}: its metadata does not parse ({first_line(e)})") from None
    return action, text


def upload_files(folder: Path, to_write: tuple[str, ...] = ()) -> tuple[list[Path], list[str]]:
    """(files to send, top-level entries left out): model files, run recipe/metrics, curves; nothing else.
    ``to_write``: files the push would write first (a dry run's card), counted as there."""
    from fnmatch import fnmatch

    missing = [n for n in MODEL_FILES if not (folder / n).is_file() and n not in to_write]
    if missing:
        raise VitconvertError(f"{folder} lacks {', '.join(missing)}")
    keep, skipped = [], []
    for entry in sorted(folder.iterdir()):
        wanted = entry.name in MODEL_FILES + RUN_FILES or any(fnmatch(entry.name, p) for p in EXTRA_PATTERNS)
        if entry.is_file() and wanted and not entry.name.startswith("."):
            keep.append(entry)
        else:
            skipped.append(entry.name + ("/" if entry.is_dir() else ""))
    keep += [folder / name for name in to_write if not (folder / name).exists()]
    return keep, skipped


# -- the push --------------------------------------------------------------------------------------------
def strings_of(name: str, text: str) -> Any:
    """The values of a run file (recipe.yaml, metrics.jsonl), to find the local paths in it; None if unreadable."""
    try:
        if name.endswith(".jsonl"):
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return yaml.safe_load(text)
    except (ValueError, yaml.YAMLError):
        return None


def public_texts(folder: Path, config: dict[str, Any], names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(file name -> the text push sends instead, local path -> its name there): config.json written from its public
    form, recipe.yaml and metrics.jsonl with each local path replaced where it stands (comments kept). The Hub gets
    what means something to a reader (:mod:`.public_names`), never the user's folders; the folder keeps the paths,
    which compare and distill need."""
    shown = {path: shown_path(path) for path in local_paths(config)}
    texts = {"config.json": json.dumps(public(config), indent=2) + "\n"} if shown and "config.json" in names else {}
    for name in (n for n in RUN_FILES if n in names):
        text = (folder / name).read_text(encoding="utf-8", errors="replace")
        shown |= {path: shown_path(path) for path in local_paths(strings_of(name, text))}
        sent = text
        for path in sorted(shown, key=len, reverse=True):  # a longer path before its own prefix
            sent = sent.replace(path, shown[path])
        if sent != text:
            texts[name] = sent
    return texts, shown


@contextmanager
def staged(folder: Path, files: list[Path], texts: dict[str, str]) -> Iterator[Path]:
    """The folder as push sends it: itself when no file changes; else a temporary folder of links to its files
    beside the changed texts (upload_folder reads through the links: no weights are copied)."""
    if not texts:
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="vitconvert-push-") as tmp:
        for file in files:
            target = Path(tmp) / file.name
            if file.name in texts:
                target.write_text(texts[file.name], encoding="utf-8")
                continue
            try:
                target.symlink_to(file.resolve())
            except OSError:  # no symlinks here (Windows without the privilege): a copy
                shutil.copy2(file, target)
        yield Path(tmp)


def default_commit_message(config: dict[str, Any]) -> str:
    """A commit message that says what was pushed: architecture, variant and vitconvert version."""
    block = config.get("vitconvert", {})
    return f"Upload {source_architecture(config)[0]} with {block.get('variant', '?')} attention (vitconvert " \
           f"{__version__})"


BAD_REF = re.compile(r"(\.\.|@\{|//|[\x00-\x20\x7f~^:?*\[\\])")


def check_revision(revision: Optional[str]) -> None:
    """A branch name git (hence the Hub) accepts: git check-ref-format's rules, so a dry run says what a push would."""
    if revision is None:
        return
    parts = revision.split("/")
    if (BAD_REF.search(revision) or revision.startswith(("/", "-")) or revision.endswith(("/", ".", ".lock"))
            or revision == "@" or any(p.startswith(".") or p.endswith(".lock") or not p for p in parts)):
        raise BadValue("revision", f"{revision!r} is not a git branch name (no '..', spaces, ~ ^ : ? * [ "
                              "\\, and no part that starts with '.' or ends with '.lock')")


def check_push_ready(repo_id: str, token: Optional[str] = None) -> None:
    """What a push needs that the folder cannot give: a valid repo id, the Hub not switched off, a token; checked
    before work that ends in a push (``distill --push-to-hub``), not after hours of training."""
    parse_repo_id(repo_id, revision_allowed=False)
    if hub_offline():
        raise VitconvertError("HF_HUB_OFFLINE is set: unset it to push (or push later with `vitconvert push`)")
    check_endpoint()
    resolve_token(token)


def push_folder(folder: Union[str, Path], repo_id: str, *, private: bool = False, revision: Optional[str] = None,
                commit_message: Optional[str] = None, token: Optional[str] = None,
                dry_run: bool = False) -> PushPlan:
    """Validate ``folder``, refresh its card and upload it to ``repo_id`` in one commit (or only plan, dry_run)."""
    folder = Path(folder).expanduser()
    repo_id, _ = parse_repo_id(repo_id, revision_allowed=False)
    if revision is not None and not revision.strip():
        raise BadValue("revision", "is empty: give a branch name or leave it out for main")
    check_revision(revision)
    if hub_offline() and not dry_run:  # before loading the folder's model (seconds to minutes)
        raise VitconvertError(f"HF_HUB_OFFLINE is set: unset it to push, or use {param('dry_run', True)} to see what "
                              "would be sent")
    if not dry_run:
        check_endpoint()
    config = check_folder(folder)
    card, text = refresh_card(folder, config, repo_id, write=not dry_run)
    files, skipped = upload_files(folder, to_write=("README.md",) if dry_run and card == "refreshed" else ())
    texts, shown = public_texts(folder, config, [f.name for f in files])
    if dry_run:
        texts["README.md"] = text
    sizes = [(f.name, len(texts[f.name].encode()) if f.name in texts else f.stat().st_size) for f in files]
    plan = PushPlan(str(folder), repo_id, revision, sizes, skipped, card,
                    dry_run, url=f"https://huggingface.co/{repo_id}" + (f"/tree/{revision}" if revision else ""),
                    token_source=token_source(token), shown_by_name=shown)
    if dry_run:
        return plan
    secret = resolve_token(token)
    from huggingface_hub import HfApi

    api = HfApi()
    stage = "create"
    try:
        api.create_repo(repo_id, token=secret, private=private, repo_type="model", exist_ok=True)
        if revision and revision != "main":
            stage = "create branch on"
            api.create_branch(repo_id, branch=revision, token=secret, repo_type="model", exist_ok=True)
        stage = "upload to"
        with staged(folder, files, texts) as sent:
            info = api.upload_folder(repo_id=repo_id, folder_path=str(sent), repo_type="model", revision=revision,
                                     token=secret, commit_message=commit_message or default_commit_message(config),
                                     allow_patterns=[glob.escape(name) for name, _ in plan.files],
                                     ignore_patterns=NEVER, delete_patterns=REPLACE_REMOTE)
    except Exception as e:
        raise VitconvertError(describe_hub_error(e, repo_id, secret, stage)) from None
    plan.commit_url = getattr(info, "commit_url", None)
    return plan
