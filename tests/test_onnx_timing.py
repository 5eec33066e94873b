"""onnx_timing: each model as an ONNX Runtime step whose output is the model's own logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_model

from vitconvert.bench import linear_copy
from vitconvert.onnx_timing import onnx_steps

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def test_every_model_becomes_a_session_run_that_computes_its_logits(monkeypatch):
    import onnxruntime as ort

    softmax = tiny_model("vit", img_size=32, depth=1).eval()  # one block: an ONNX export costs about its depth
    models = {"softmax": softmax, "relu": linear_copy(softmax, "relu").eval()}
    x = torch.randn(2, 3, 32, 32)
    runs: list[tuple[int, np.ndarray]] = []  # (session, logits) of every run
    run = ort.InferenceSession.run

    def recording_run(session, names, feed):
        logits = run(session, names, feed)[0]
        runs.append((id(session), logits))
        return [logits]

    monkeypatch.setattr(ort.InferenceSession, "run", recording_run)
    steps = onnx_steps(models, x)
    assert list(steps) == ["softmax", "relu"]
    for name, step in steps.items():
        step()
        with torch.no_grad():
            np.testing.assert_allclose(runs[-1][1], models[name](x).numpy(), rtol=1e-4, atol=1e-4)
    assert len({session for session, _ in runs}) == 2  # one session per model
