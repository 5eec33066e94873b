"""The fused kernels' environment settings, parsed once into a :class:`KernelSettings` value: a bad value is a
one-line error where a model is made (:func:`.dispatch.use_fused_kernels`), not a silent default deep in a launch,
and a launch reads the value, never the environment.

``VITCONVERT_FUSED`` (on/off), ``VITCONVERT_FUSED_TILE`` (the dots' operands for half inputs),
``VITCONVERT_FUSED_CONFIG`` (BLOCK_N,num_warps[,num_stages] for tuning sweeps), ``VITCONVERT_MHLA_FORM``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from ...errors import VitconvertError

ENV = "VITCONVERT_FUSED"
TILE_ENV = "VITCONVERT_FUSED_TILE"
CONFIG_ENV = "VITCONVERT_FUSED_CONFIG"
FORM_ENV = "VITCONVERT_MHLA_FORM"
FORMS = ("auto", "pairwise", "blocked")  # MHLA's kernels: chosen per call by cost, or forced (ops/pairwise/op.py)
SWITCH = {"0": False, "off": False, "false": False, "no": False, "1": True, "on": True, "true": True, "yes": True}
TILES = ("tf32", "half")
CONFIG_BLOCK_NS = (16, 32, 64, 128)  # tl.dot's smallest tile up to dispatch.SPLIT_ROUND, which each must divide
CONFIG_WARPS = (1, 2, 4, 8, 16)
CONFIG_STAGES = (1, 2, 3, 4)
# chunks in flight while one computes (said at the launch): 2 takes fewer instructions per element than Triton's default
# 3 in every ELU/ReLU/InLine main loop and does not spill in the one-launch backward (benchmarks/kernel_instructions.py)
DEFAULT_STAGES = 2


def _given(value: Optional[str]) -> Optional[str]:
    """An environment setting as given: stripped and lower-case; None when unset or blank."""
    return value.strip().lower() if value and value.strip() else None


def fused_switch(value: Optional[str]) -> bool:
    given = _given(value)
    if given is None:
        return True
    if given not in SWITCH:
        raise VitconvertError(f"{ENV}={value!r}: expected 0 (the eager form everywhere) or 1 (the fused kernels "
                              "where they can run)")
    return SWITCH[given]


def tile_setting(value: Optional[str]) -> str:
    """``VITCONVERT_FUSED_TILE``: the dots' operand type for half inputs (:func:`.dispatch.tile_args`)."""
    return _one_of(TILE_ENV, value, TILES)


def form_setting(value: Optional[str]) -> str:
    """``VITCONVERT_MHLA_FORM``: MHLA's kernels in the pairwise or the blocked form, or ``auto`` (by cost,
    :func:`.pairwise.op.pairwise_is_cheaper`)."""
    return _one_of(FORM_ENV, value, FORMS)


def _one_of(name: str, value: Optional[str], choices: tuple[str, ...]) -> str:
    """The setting ``name`` as given (the first of ``choices`` when unset), or a one-line error."""
    given = _given(value)
    if given is None:
        return choices[0]
    if given not in choices:
        raise VitconvertError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return given


def config_setting(value: Optional[str]) -> Optional[tuple[int, int, int]]:
    """``VITCONVERT_FUSED_CONFIG=BLOCK_N,num_warps[,num_stages]`` (tuning sweeps) as (BLOCK_N, num_warps,
    num_stages), num_stages :data:`DEFAULT_STAGES` when not given; or None."""
    given = _given(value)
    if given is None:
        return None
    parts = given.split(",")
    parts += [str(DEFAULT_STAGES)] if len(parts) == 2 else []
    try:
        block_n, warps, stages = (int(p) for p in parts)
    except ValueError:  # not two or three integers
        block_n = warps = stages = 0
    if block_n not in CONFIG_BLOCK_NS or warps not in CONFIG_WARPS or stages not in CONFIG_STAGES:
        raise VitconvertError(f"{CONFIG_ENV}={value!r}: expected BLOCK_N,num_warps[,num_stages] with BLOCK_N one of "
                              f"{', '.join(map(str, CONFIG_BLOCK_NS))}, num_warps one of "
                              f"{', '.join(map(str, CONFIG_WARPS))} and num_stages one of "
                              f"{', '.join(map(str, CONFIG_STAGES))}, e.g. 32,8 or 64,4,2")
    return block_n, warps, stages


@dataclass(frozen=True)
class KernelSettings:
    """The four variables as read (:meth:`read`): what every launch takes instead of the environment."""

    fused: bool = True  # VITCONVERT_FUSED: the kernels where a call can take them
    tile: str = TILES[0]  # VITCONVERT_FUSED_TILE: the dots' operands for half inputs (TF32 or 16-bit tiles)
    config: Optional[tuple[int, int, int]] = None  # VITCONVERT_FUSED_CONFIG: (BLOCK_N, num_warps, num_stages)
    form: str = FORMS[0]  # VITCONVERT_MHLA_FORM
    tile_given: bool = False  # VITCONVERT_FUSED_TILE set: ELU/ReLU/InLine's bf16 tiles give way to it

    @classmethod
    def read(cls, environ: Optional[Mapping[str, str]] = None) -> KernelSettings:
        """The settings of ``environ`` (the process's when None), each checked (a one-line error for a bad one)."""
        environ = os.environ if environ is None else environ
        return cls(fused_switch(environ.get(ENV)), tile_setting(environ.get(TILE_ENV)),
                   config_setting(environ.get(CONFIG_ENV)), form_setting(environ.get(FORM_ENV)),
                   _given(environ.get(TILE_ENV)) is not None)

    @property
    def stages(self) -> int:
        """num_stages of the ELU/ReLU/InLine launches: the config's third number or :data:`DEFAULT_STAGES`."""
        return self.config[2] if self.config else DEFAULT_STAGES
