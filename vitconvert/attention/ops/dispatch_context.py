"""The context's dispatch: everything a launch consults besides its tensors, as one value (:class:`Dispatch`),
the process's unless a block chose another (:func:`kernels_on`). Diagnostics and tests inject through it instead
of rebinding module globals; :mod:`.dispatch` re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from .settings import KernelSettings

TTT_DTYPES = (torch.float16, torch.bfloat16)  # what TTT's kernels take on a GPU (dispatch.TTT_MAX_HEAD_DIM says why)
SPLIT_ROUND = 128  # a program's token range is a multiple of this (and of every BLOCK_N)


@dataclass
class Dispatch:
    """What every launch consults besides its tensors: one value per context (:func:`current`), the process's
    unless a block chose another (:func:`kernels_on`)."""

    devices: tuple[str, ...] = ("cuda",)  # device types the kernels run on (the CPU's under TRITON_INTERPRET=1)
    settings: Optional[KernelSettings] = None  # None: the environment's, read once (environment_settings)
    launcher: Optional[Callable[..., Any]] = None  # every launch through this instead (launches_through)
    programs: Optional[int] = None  # programs a launch wants; None: PROGRAMS_PER_SM per SM of the tensor's GPU
    split_round: int = SPLIT_ROUND
    capability: Optional[tuple[int, int]] = None  # the GPU generation launches are made for; None: the tensor's
    ttt_dtypes: tuple[torch.dtype, ...] = TTT_DTYPES  # (TTT's kernels take float32 too; no sm_90 GPU fits them)
    rms_norm_devices: tuple[str, ...] = ("cuda",)  # where half RMSNorms take torch's fused kernels (norms/lean.py)
    generation_checked: tuple[str, ...] = ("cuda",)  # device types whose generation is checked (MIN_CAPABILITY)
    older_triton: Optional[bool] = None  # whether Triton is older than 3.8 (None: the installed one's)
    softmax_extra_bytes: Optional[int] = None  # room for kept partials a token (None: launch_plan's; tests lift it)
    through_ops: bool = False  # every op call through the custom-op dispatcher, as tracers see them (direct)
    direct_under_modes: bool = False  # op calls direct under a dispatch mode that only counts (host_overhead's)
    fakes: Optional[list] = None  # (op, real, fake) that differ, where a diagnostic checks them (calls.call_op)
    capabilities: dict[torch.device, bool] = field(default_factory=dict)  # supported_generation's answers
    settled: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)  # settings -> leaner that fit
    unavailable: dict[str, str] = field(default_factory=dict)  # op -> why its kernels were turned off


_PROCESS = Dispatch()  # every context's (the autograd engine's threads' too) unless one set its own
_CURRENT: ContextVar[Optional[Dispatch]] = ContextVar("vitconvert_dispatch", default=None)


def current() -> Dispatch:
    """The context's :class:`Dispatch`."""
    return _CURRENT.get() or _PROCESS


@contextmanager
def kernels_on(device_type: Optional[str] = None, **changes: Any) -> Iterator[Dispatch]:
    """Inside: the context's dispatch with ``changes`` (its fields), the kernels also on ``device_type`` (the CPU's,
    in Triton's interpreter), and what launches find out about the GPU kept inside (a cross-build's GPU, or a test's
    refusing kernel, is not this one). Yields the dispatch in force."""
    base = current()
    devices = changes.pop("devices", base.devices)
    devices = devices if device_type is None else tuple(dict.fromkeys((*devices, device_type)))
    inner = replace(base, devices=devices, capabilities={}, settled={}, unavailable={}, **changes)
    token = _CURRENT.set(inner)
    try:
        yield inner
    finally:
        _CURRENT.reset(token)


_ENVIRONMENT: dict[str, KernelSettings] = {}  # (environment_settings': a dict, which dynamo reads as a constant)


def environment_settings() -> KernelSettings:
    """The process's launch settings: the environment's, read once (a bad value raises, and is not kept)."""
    found = _ENVIRONMENT.get("read")
    if found is None:
        found = _ENVIRONMENT["read"] = KernelSettings.read()
    return found


def launch_settings() -> KernelSettings:
    """The settings a launch takes: the context's dispatch's (:func:`kernels_on`), else the environment's."""
    return current().settings or environment_settings()
