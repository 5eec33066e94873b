"""The test harness's Triton interpreter rounds as the GPU does (tests/helpers.py, interpreter_rounds_to_nearest):
the kernels' bf16 tolerances in test_fused.py and test_fused_ttt.py are set against a GPU's rounding; and it skips
only checks whose result it drops (interpreter_skips_overflow_checks)."""

from __future__ import annotations

import pytest
import torch
from helpers import interpreter_rounds_to_nearest

from vitconvert.attention.ops import dispatch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
if torch.cuda.is_available() or not dispatch.interpreting():
    pytest.skip("for Triton's interpreter (tests/conftest.py chooses it without a GPU)", allow_module_level=True)


@triton.jit
def _to_bf16_kernel(X, Y, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < N).to(tl.bfloat16), mask=i < N)


def test_float32_to_bf16_in_a_kernel_rounds_to_nearest_even_as_torch_does():
    """Halfway cases, both signs, values just above and below a bf16 step, and a random spread: a truncating
    cast (the interpreter's own) differs from torch on about half of them."""
    assert interpreter_rounds_to_nearest(), "this triton's interpreter has no _convert_float to round through"
    one = torch.tensor(1.0).view(torch.int32)
    steps = torch.tensor([0x7FFF, 0x8000, 0x8001, 0x17FFF, 0x18000, 0x18001], dtype=torch.int32)
    edges = (one + steps).view(torch.float32)
    x = torch.cat([edges, -edges, torch.randn(500, generator=torch.Generator().manual_seed(0)) * 30])
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](x, y, x.numel(), BLOCK=1024)
    expected = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(expected.float(), x.view(torch.int32).bitwise_and(-65536).view(torch.float32))


def test_the_skipped_overflow_check_is_one_the_interpreter_would_drop():
    """dispatch switches off the interpreter's integer overflow check, which reaches Triton's device_assert, which
    asserts only under the options' debug: with debug off, as here, skipping it loses nothing."""
    from triton.runtime import interpreter

    assert hasattr(interpreter.interpreter_builder.options, "sanitize_overflow"), "this triton has no such check"
    dispatch._no_interpreter_overflow_checks()
    options = interpreter.interpreter_builder.options
    assert not options.sanitize_overflow and not options.debug
