"""benchmarks/pair_features.py: the GPU's first check of ELU's and ReLU's φ on bf16 pairs (inline PTX) against their
float32 form. Here, without a GPU: its kernel's float32 form in Triton's interpreter against torch's φ, and no PTX run
on a CPU (the PTX is built for sm_90 with the kernels that take it: test_kernel_instructions.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_benchmark

from vitconvert.attention.ops import dispatch

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def pairs():
    return load_benchmark("pair_features")


@pytest.mark.skipif(not dispatch.interpreting(), reason="the float32 form runs in Triton's interpreter here")
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # (the interpreter's numpy: eˣ of large x is inf)
def test_the_float32_form_is_torchs_phi_rounded(pairs):
    x = pairs.every_bf16(torch.device("cpu"))[::61]  # (a spread of ~1000 values, every exponent)
    wide = x.float()
    want = {"elu": torch.where(wide > 0, wide + 1, torch.exp(wide)), "relu": torch.relu(wide)}
    for name, feature in pairs.FEATURES.items():
        got = pairs.feature_map(x, feature, emulate=True)
        normal = want[name].abs() >= torch.finfo(torch.bfloat16).tiny  # (the interpreter flushes subnormals)
        assert torch.equal(got[normal], want[name].to(torch.bfloat16)[normal]), name
    assert pairs.mismatches(torch.device("cpu")) == {"elu": None, "relu": None}  # (no PTX runs on a CPU)

