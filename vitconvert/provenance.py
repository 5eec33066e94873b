"""What a converted model records of itself: its source, how it was converted (the init recipe and the parameter
groups it made), and what load found in config.json's vitconvert block. convert and load write the record;
save, export and distill read it back.

It lives in one attribute of the model, named here only. The student is timm's class, not ours, so there is no
field of our own to hold it; and the record must travel with the model through ``copy.deepcopy`` (distill's
export copy, a user's copy), ``.to()`` and timm's EMA wrapper, where a registry keyed by the model object would
drop it without a word and the next ``save`` would write a folder that no longer names its source."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from torch import nn

ATTRIBUTE = "vitconvert_report"


def attach(model: nn.Module, report: Mapping[str, Any]) -> None:
    """Give ``model`` its record (a copy of ``report``, so the caller's dict and the model's never alias)."""
    setattr(model, ATTRIBUTE, copy.deepcopy(dict(report)))


def report_of(model: nn.Module) -> dict[str, Any]:
    """A copy of ``model``'s record; empty for a model vitconvert neither converted nor loaded."""
    return copy.deepcopy(dict(getattr(model, ATTRIBUTE, None) or {}))
