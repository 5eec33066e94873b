"""``vitconvert upgrade``: a folder in an older layout (format 1, or num_classes in model_args), or one timm's own
savers wrote from a vitconvert model (pickle included), rewritten in place as ``save`` writes it today."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from .card import CARD_MARKER
from .errors import VitconvertError, disk_full, param
from .folder import (
    TIMM_PICKLE,
    WEIGHTS,
    OldFolderWarning,
    check_folder,
    in_hub_cache,
    load_folder_model,
    load_timm_pickle,
    pickled_by_timm,
    read_config,
    upgrade_reasons,
    weights_in,
    write_model_files,
)
from .provenance import report_of
from .writer import apply_umask, output_lock, temporary_sibling, writable_error

FOLDER_FILES = (WEIGHTS, "config.json", "README.md")  # what write_model_files writes, in the order upgrade moves them


def upgrade_folder(folder: Path) -> Optional[dict[str, Any]]:
    """Rewrite a folder that ``load`` reads, in an older layout or written by timm's own savers, in place as
    ``save`` writes it today (same weights; its other files, links included, left as they are; a card without
    vitconvert's marker kept as the user's). Returns what it was (``{"format_version": 1, ...}``, or
    ``{"saved_by": "timm"}``), or None when it was already current (nothing is written).

    A symlink to the folder upgrades the real folder. The three files are written beside it, then moved in:
    weights, config.json, README.md, so an interrupted upgrade leaves a folder that loads and that upgrade finishes
    (timm's pickle, pytorch_model.bin, written as model.safetensors and kept, counts until config.json records it)."""
    folder = Path(folder).expanduser().resolve()  # through a link: the real folder, never the link replaced
    if in_hub_cache(folder):
        raise VitconvertError(f"{folder} is a snapshot in the Hub cache: upgrade a copy: download it to a "
                              f"folder of your own (`hf download REPO` with {param('local_dir', 'DIR')}), then "
                              "upgrade that folder")
    config = read_config(folder)
    pickled = weights_in(folder).name == TIMM_PICKLE or ((folder / TIMM_PICKLE).is_file() and TIMM_PICKLE != (
        (config.get("vitconvert") or {}).get("upgraded_from") or {}).get("weights"))  # (not recorded: a stopped run)
    if pickled_by_timm(folder, config):
        model = load_timm_pickle(folder, config)
    else:
        check_folder(folder, config)
        if not upgrade_reasons(config) and not pickled:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OldFolderWarning)
            model = load_folder_model(folder, config)
    block = config.get("vitconvert")
    meta = {k: v for k, v in report_of(model).items() if k != "saved_by"}
    was = {"saved_by": "timm"} if block is None else {"format_version": 1, **{k: block[k] for k in (
        "format_version", "versions") if k in block}}
    meta["upgraded_from"] = {**was, **({"weights": TIMM_PICKLE} if pickled else {})}
    card_file = folder / "README.md"
    own_card = card_file.is_file() and CARD_MARKER not in card_file.read_text(errors="replace")
    with output_lock(folder), files_beside(folder) as tmp:
        write_model_files(model, tmp, meta, card=card_file.read_text() if own_card else None)
        for name in FOLDER_FILES:
            os.replace(tmp / name, folder / name)
    return meta["upgraded_from"]


@contextmanager
def files_beside(folder: Path) -> Iterator[Path]:
    """A temporary sibling of ``folder`` (removed at the end, or by a later run if this one is killed) to write
    files in before they are moved into it; OSErrors and a full disk as one line."""
    tmp = temporary_sibling(folder)
    try:
        apply_umask(tmp)
        yield tmp
    except OSError as e:
        raise writable_error(folder, e) from None
    except Exception as e:  # a library's own error type for a full disk (safetensors' SafetensorError)
        if disk_full(e):
            raise VitconvertError(f"cannot write {folder}: No space left on device (in {folder.parent})") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
