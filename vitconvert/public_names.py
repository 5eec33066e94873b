"""What a reader elsewhere sees of a path on this machine. A converted folder records a local source as an absolute
path (config.json: compare and distill find the teacher from any directory); the model card and everything push
sends show only what means something to a reader: the folder's or file's name (``src (local)``), or the Hub repo a
Hub-cache snapshot belongs to, never the user's folders (``/home/alice/secret-project/...``)."""

from __future__ import annotations

import re
from pathlib import PureWindowsPath
from typing import Any

# A path as vitconvert records one: absolute (POSIX or Windows), home-relative, ./ or ../, local-dir:, file://
LOCAL = re.compile(r"^(local-dir:|file://|~|\.{1,2}(?:[/\\]|$)|/|[A-Za-z]:[/\\])")
LOCAL_MARK = " (local)"  # what follows a local path's name: `src (local)`
# huggingface_hub's cache layout: .../models--ORG--NAME/snapshots/REVISION/...
SNAPSHOT = re.compile(r"models--(?P<org>[^/\\]+?)--(?P<name>[^/\\]+)[/\\]snapshots[/\\]")


def is_local_path(text: str) -> bool:
    """Whether ``text`` is a path on this machine (not a timm name, an alias, ``digits`` or ``hf-hub:org/name``)."""
    return bool(LOCAL.match(text))


def shown_path(text: str) -> str:
    """``text`` as a reader elsewhere sees it: a local path as its last name, ``src (local)``; a Hub-cache snapshot as
    the repo it is of, ``hf-hub:org/name``; anything else as it is."""
    if not is_local_path(text):
        return text
    if snapshot := SNAPSHOT.search(text):
        return f"hf-hub:{snapshot['org']}/{snapshot['name']}"
    name = PureWindowsPath(re.sub(r"^(local-dir:|file://)", "", text)).name  # splits at / and at \
    return f"{name if name not in ('', '.', '..', '~') else 'a folder'}{LOCAL_MARK}"


def shown_as_local(text: str) -> bool:
    """Whether ``text`` is a local path as ``shown_path`` shows it: a name that leads nowhere on another machine."""
    return text.endswith(LOCAL_MARK)


def public(value: Any) -> Any:
    """``value`` (config.json, a recipe, a metrics record) with every local path string shown as ``shown_path``."""
    if isinstance(value, dict):
        return {k: public(v) for k, v in value.items()}
    if isinstance(value, list):
        return [public(v) for v in value]
    return shown_path(value) if isinstance(value, str) else value


def local_paths(value: Any) -> set[str]:
    """The local path strings anywhere in ``value`` (what ``public`` replaces)."""
    if isinstance(value, dict):
        return set().union(*(local_paths(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(local_paths(v) for v in value))
    return {value} if isinstance(value, str) and is_local_path(value) else set()
