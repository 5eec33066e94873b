"""Forward hooks on the attention modules of teacher and student: one forward each, nothing recomputed.

The teacher's hooks keep each softmax attention's output (and, for ``teacher-forced``, its input); the
student's keep each linear attention's output. In teacher-forced mode the student's attention modules are
also applied to the teacher's inputs at the same layer, as LoLCATs does, inside the student's forward so
that DDP and FSDP see a single call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from .attention import LinearAttention
from .errors import VitconvertError, param
from .surgery import attention_modules, find_softmax_attention

Captured = tuple[tuple[Any, ...], dict[str, Any]]  # (args, kwargs) of one attention call
# (attention module, its input) -> what a tap keeps instead of the output (distill/attention_weights.py: the weights)
Tap = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def attention_width(module: nn.Module) -> int:
    """The width of an attention module's output (its projection's), which the attention-output loss compares."""
    proj = getattr(module, "proj", None)
    if isinstance(proj, nn.Linear):
        return proj.out_features
    qkv = getattr(module, "qkv", None) or getattr(module, "q_proj", None)
    return int(qkv.in_features)


def attention_pairs(student: nn.Module, teacher: nn.Module) -> tuple[list[LinearAttention], list[nn.Module]]:
    """Student linear attention and the teacher's softmax attention at the same layers; a hybrid's kept softmax
    layers have nothing to distil and are left out. Refuses models that differ in depth or width."""
    layers = [m for _, m in attention_modules(student)]
    theirs = [m for _, m in find_softmax_attention(teacher)]
    if not any(isinstance(m, LinearAttention) for m in layers):
        raise VitconvertError("the student has no linear attention: convert it first (vitconvert convert)")
    if not theirs:
        raise VitconvertError(f"the teacher has no softmax attention: give a softmax ViT as {param('teacher')} "
                              "(a converted vitconvert model cannot teach)")
    if len(layers) != len(theirs):
        raise VitconvertError(f"teacher and student differ in depth: the teacher has {len(theirs)} attention "
                              f"layers, the student {len(layers)}; use the student's softmax source as "
                              f"{param('teacher')}")
    for i, (s, t) in enumerate(zip(layers, theirs, strict=True)):
        if attention_width(s) != attention_width(t):
            raise VitconvertError(f"teacher and student differ in width at layer {i}: {attention_width(t)} vs "
                                  f"{attention_width(s)}; use the student's softmax source as {param('teacher')}")
    pairs = [(s, t) for s, t in zip(layers, theirs, strict=True) if isinstance(s, LinearAttention)]
    return [s for s, _ in pairs], [t for _, t in pairs]


class TeacherTap:
    """The teacher, run once per batch under no_grad in eval mode, with its attention outputs (or what ``tap``
    makes of each layer's input) kept."""

    def __init__(self, teacher: nn.Module, modules: list[nn.Module], keep_inputs: bool, tap: Optional[Tap] = None):
        self.teacher = teacher.eval().requires_grad_(False)
        self.keep_inputs = keep_inputs
        self.tap = tap
        self.outputs: list[torch.Tensor] = []
        self.inputs: list[Captured] = []
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in modules]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        self.outputs.append(output if self.tap is None else self.tap(module, args[0]))
        if self.keep_inputs:
            self.inputs.append((args, kwargs))

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[Captured]]:
        self.outputs, self.inputs = [], []
        logits = self.teacher(images)
        outputs, inputs = self.outputs, self.inputs
        self.outputs, self.inputs = [], []
        return logits, outputs, inputs

    def close(self) -> None:
        """Remove the hooks, so a teacher used after distillation runs as a plain model again."""
        for handle in self.handles:
            handle.remove()


class DistillStudent(nn.Module):
    """The student and its attention outputs (or what ``tap`` makes of each layer's input) behind one forward; its
    state dict is the student's, prefixed."""

    def __init__(self, student: nn.Module, attention: list[LinearAttention], tap: Optional[Tap] = None):
        super().__init__()
        self.student = student
        self._attention = attention  # student submodules, deliberately not registered a second time
        self._tap = tap
        self._captured: list[torch.Tensor] = []
        self._capturing = False
        self.handles = [m.register_forward_hook(self._hook) for m in attention]

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._capturing:
            self._captured.append(output if self._tap is None else self._tap(module, args[0]))

    def forward(self, images: Optional[torch.Tensor], forced: Optional[list[Captured]] = None,
                need_logits: bool = True, capture: bool = True) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
        """(logits or None, attention outputs): on its own hidden states, or on ``forced`` teacher inputs."""
        self._captured, self._capturing = [], capture and forced is None
        try:
            logits = self.student(images) if need_logits else None
        finally:
            self._capturing = False
        outputs, self._captured = self._captured, []
        if forced is not None and capture:
            outputs = self._on_forced(forced)
        return logits, outputs

    def _on_forced(self, forced: list[Captured]) -> list[torch.Tensor]:
        """Each attention module called on the teacher's input at its layer; with a tap, what the tap makes of it,
        taken in the module's forward hook as on the student's own inputs (where FSDP still holds the gathered
        weights: its post-forward hook is registered after ours)."""
        if self._tap is None:
            return [m(*args, **kwargs) for m, (args, kwargs) in zip(self._attention, forced, strict=True)]
        self._captured, self._capturing = [], True
        try:
            for m, (args, kwargs) in zip(self._attention, forced, strict=True):
                m(*args, **kwargs)
        finally:
            self._capturing = False
        outputs, self._captured = self._captured, []
        return outputs

    def close(self) -> None:
        """Remove the hooks, so the student saved or evaluated after the run carries none."""
        for handle in self.handles:
            handle.remove()
