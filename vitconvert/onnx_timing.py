"""Models as ONNX Runtime steps to time: each exported as ``vitconvert export`` writes it, run in a CPU session.

``benchmark(..., backend="onnxruntime")`` times these instead of the PyTorch forwards, so the speedups are the
ones a deployment on ONNX Runtime would see.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from .export import export_onnx, require_onnx


def onnx_steps(models: dict[str, nn.Module], x: torch.Tensor) -> dict[str, Callable[[], None]]:
    """One ONNX Runtime inference of ``x`` per model, on torch's thread count (the sessions hold the exported
    graphs: the files are gone when this returns)."""
    require_onnx()  # one line naming the extra, before the import would fail
    import onnxruntime as ort

    steps: dict[str, Callable[[], None]] = {}
    feed = x.cpu().numpy()
    with tempfile.TemporaryDirectory() as folder:
        for name, model in models.items():
            path = Path(folder) / f"{name}.onnx"
            export_onnx(model.eval(), x.cpu(), path)
            options = ort.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            steps[name] = partial(session.run, None, {session.get_inputs()[0].name: feed})
    return steps
