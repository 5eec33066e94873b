"""BenchConfig: every field checked once, where the config is made, naming the field; and passed whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import tiny_model

from vitconvert.bench import benchmark
from vitconvert.bench_config import BenchConfig, resolve_device
from vitconvert.errors import BadValue


@pytest.mark.parametrize(("fields", "name", "message"), [
    ({"variants": ["elu", "softmax"]}, "variants", "unknown variant 'softmax'; valid: "),
    ({"variants": "elu"}, "variants", "a list of variant names"),
    ({"img_sizes": [224, 0]}, "img_sizes", r"positive integers \(got \[224, 0\]\)"),
    ({"img_sizes": [22.4]}, "img_sizes", "positive integers"),
    ({"batch_size": 0}, "batch_size", r"at least 1 \(got 0\)"),
    ({"repeats": 0}, "repeats", r"at least 1 \(got 0\)"),
    ({"warmup": -1}, "warmup", r"at least 0 \(got -1\)"),
    ({"threads": 0}, "threads", r"at least 1 \(got 0\)"),
    ({"clock": "sundial"}, "clock", "unknown clock 'sundial'; valid: wall, cpu"),
    ({"backend": "tensorrt"}, "backend", "unknown backend 'tensorrt'; valid: torch, onnxruntime"),
    ({"device": "tpu"}, "device", "unknown device 'tpu'; valid: cpu, cuda"),
    ({"device": "cuda:x"}, "device", "unknown device 'cuda:x'"),  # torch.device's own error, once a traceback
    ({"amp": "bf17"}, "amp", "unknown autocast dtype 'bf17'"),
    ({"backend": "onnxruntime", "train": True}, "backend", "inference on the CPU only"),
    ({"backend": "onnxruntime", "amp": "bfloat16"}, "backend", "inference on the CPU only"),
    ({"backend": "onnxruntime", "compile": "inductor"}, "backend", "inference on the CPU only"),
])
def test_each_bad_field_is_refused_by_name_when_the_config_is_made(fields, name, message):
    with pytest.raises(BadValue, match=message) as e:
        BenchConfig("no/such/source", **fields)  # the source is not read: nothing runs before the checks
    assert e.value.name == name
    assert "--" not in str(e.value)  # a library message names parameters, never flags


def test_a_good_config_is_frozen_and_resolves_device_and_autocast():
    config = BenchConfig("deit_tiny", ["elu"], [224], device="cpu", amp="float32")
    assert config.torch_device() == torch.device("cpu") and config.autocast is None
    assert BenchConfig("deit_tiny", device="cpu", amp="float16").autocast == "float16"
    assert BenchConfig("deit_tiny", img_sizes=range(224, 225)).img_sizes == range(224, 225)  # any integers
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.repeats = 0  # checked once: a config cannot turn bad afterwards


def test_onnxruntime_runs_on_the_cpu_even_where_a_gpu_is_the_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(None) == torch.device("cuda")
    config = BenchConfig("deit_tiny", backend="onnxruntime")  # auto autocast: none for ONNX Runtime
    assert config.torch_device() == torch.device("cpu") and config.autocast is None


def test_a_missing_gpu_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BadValue, match="cuda:1: no CUDA GPU is available") as e:
        BenchConfig("deit_tiny", device="cuda:1")
    assert e.value.name == "device"


def test_benchmark_takes_the_config_whole_or_its_fields_as_arguments():
    model = tiny_model("vit", img_size=32)
    fields = dict(variants=["relu"], repeats=1, warmup=0, threads=1, memory=False, device="cpu", clock="cpu")
    lines: list[str] = []
    whole = benchmark(BenchConfig(model, **fields), log=lines.append)
    spread = benchmark(model, **fields)
    assert whole.to_dict().keys() == spread.to_dict().keys()
    assert [(r.model, r.mode, r.tokens) for r in whole.rows] == [(r.model, r.mode, r.tokens) for r in spread.rows]
    assert (whole.clock, whole.threads, whole.amp, whole.backend) == ("cpu", 1, None, "torch")
    assert lines == ["32 px (17 tokens), infer: softmax, relu"]
    with pytest.raises(TypeError, match="config's fields"):
        benchmark(BenchConfig(model), repeats=2)  # one place says how the run goes
