"""What one ``benchmark`` run measures and how: a ``BenchConfig``, checked once, where it is made.

The command line builds one from its flags and passes it whole; a Python caller builds one (or passes the same
keyword arguments to ``benchmark``). Every field that can be checked without the model is checked here, with
the field's name (``BadValue``); ``keep_softmax`` and ``options`` need the model's depth and variant, and are
checked when the models are built.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from .attention import variant_class
from .errors import BadValue
from .selection import Spec

AUTO = "auto"  # the autocast dtype the device calls for (resolve_amp)
BACKENDS = ("torch", "onnxruntime")
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
DEVICE_TYPES = ("cpu", "cuda")  # the devices whose clocks and memory bench reads


@dataclass(frozen=True)
class BenchConfig:
    """The source, the variants and sizes to time against it, and the conditions of the run (see
    ``vitconvert.bench``). ``variants``/``img_sizes`` None: the source's own (a folder's variant, or all; its
    image size); ``amp`` ``"auto"``: bfloat16 on CUDA, none on the CPU (``resolve_amp``); ``compile``: a
    torch.compile backend; ``backend="onnxruntime"``: every model exported to ONNX and run in ONNX Runtime."""

    source: Union[str, nn.Module]
    variants: Optional[Sequence[str]] = None
    img_sizes: Optional[Sequence[int]] = None
    batch_size: int = 1
    train: bool = False  # also time a training step (forward + backward of a cross-entropy loss)
    repeats: int = 5  # timed rounds; every model runs once per round, in turns
    warmup: int = 1  # untimed rounds first
    pretrained: bool = True  # weights do not change speed; False skips their download
    device: Optional[str] = None  # cpu, cuda, cuda:1; None: a GPU if any
    # torch CPU threads during the run; None: torch's, as `vitconvert bench` without --threads. Unlike the other
    # jobs (loading.model_threads), no small-model rule: the count is a condition of what is timed, so it is the
    # caller's choice, and the report records it
    threads: Optional[int] = None
    options: Optional[dict[str, Any]] = None  # variant options, over a folder's own
    memory: bool = True  # also measure peak memory (one more step per model)
    clock: str = "wall"  # or "cpu": the process's CPU time (steady on a shared machine with one thread)
    amp: Optional[str] = AUTO
    compile: Optional[str] = None
    backend: str = "torch"
    keep_softmax: Spec = None  # layers every variant keeps softmax (hybrids); None: a hybrid folder's own

    def __post_init__(self) -> None:
        if isinstance(self.variants, str):
            raise BadValue("variants", f"expects a list of variant names, e.g. [{self.variants!r}]")
        for name in self.variants or ():
            variant_class(name, param="variants")
        if any(not isinstance(size, numbers.Integral) or size < 1 for size in self.img_sizes or ()):
            raise BadValue("img_sizes", f"must be positive integers (got {list(self.img_sizes)})")
        for name, least in (("batch_size", 1), ("repeats", 1), ("warmup", 0), ("threads", 1)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise BadValue(name, f"must be at least {least} (got {value})")
        if self.clock not in CLOCKS:
            raise BadValue("clock", f"unknown clock {self.clock!r}; valid: {', '.join(CLOCKS)}")
        if self.backend not in BACKENDS:
            raise BadValue("backend", f"unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        self.torch_device()  # refuses an unknown or missing device
        self._check_amp_and_backend()

    def _check_amp_and_backend(self) -> None:
        amp = self.autocast
        if amp is not None and not isinstance(getattr(torch, amp, None), torch.dtype):
            raise BadValue("amp", f"unknown autocast dtype {amp!r}; e.g. bfloat16, float16")
        if self.backend == "onnxruntime" and (self.train or amp or self.compile or self.torch_device().type != "cpu"):
            raise BadValue("backend", "onnxruntime times inference on the CPU only (no training, autocast or "
                                      "compile)")

    def torch_device(self) -> torch.device:
        """The device to run on: the one asked for, else a GPU if any (the CPU for ONNX Runtime)."""
        return resolve_device(self.device or ("cpu" if self.backend == "onnxruntime" else None))

    @property
    def autocast(self) -> Optional[str]:
        """The autocast dtype of every forward (``amp`` resolved), None for the model's own float32."""
        return resolve_amp(self.amp, self.device, self.backend)


def resolve_device(requested: Optional[str]) -> torch.device:
    """``requested`` as a device bench can time (cpu, or an available cuda); None: a GPU if any."""
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise BadValue("device", f"unknown device {requested!r}; valid: {', '.join(DEVICE_TYPES)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadValue("device", f"{requested}: no CUDA GPU is available")
    return device


def resolve_amp(amp: Optional[str], device: Optional[str], backend: str = "torch") -> Optional[str]:
    """The autocast dtype a run uses: ``"auto"`` is bfloat16 on a CUDA device (given, or the default one) with
    the torch backend, and none elsewhere; ``"none"`` and ``"float32"`` are none."""
    if amp == AUTO:
        on_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0] == "cuda"
        return "bfloat16" if on_cuda and backend == "torch" else None
    return None if amp in (None, "none", "float32") else amp
