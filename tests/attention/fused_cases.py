"""What the fused-kernel test modules share (test_fused*.py): the device, the kernels-here fixture (autouse where
a module imports it), q/k/v and masks, tolerances and the float64 oracle check."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from vitconvert.attention.kernel import elu_feature_literal, relu_feature
from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.linear import op as fused

from . import helpers
from .helpers import rel_error

# A module that imports this one is skipped where the kernels cannot run: no Triton, or neither a GPU nor Triton's
# interpreter (chosen by tests/conftest.py before anything imports triton).
pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
if not torch.cuda.is_available() and not dispatch.interpreting():
    pytest.skip("no GPU, and Triton's interpreter was not chosen before triton was imported (tests/conftest.py)",
                allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED_VARIANTS = ("elu", "relu", "inline", "mhla")


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch):
    """The kernels on this machine's device, with token ranges small enough that heads split across programs;
    float32 convolutions of the eager parts (LePE, InLine's residual) in full float32, as the oracles are."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    with dispatch.kernels_on(DEVICE, split_round=64, programs=64) as inner:
        yield inner


def qkv(B=2, H=2, N=150, d=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g).to(DEVICE, dtype).requires_grad_() for _ in range(3)]


def padding_mask(B: int, N: int) -> torch.Tensor:
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[-1, N // 3:] = False  # the last item is padded
    return mask.to(DEVICE)


# tolerance of the kernels against a float64 oracle: float32 sums, or bf16 inputs and output (bf16: 1.7e-3 in
# values and 2.3e-3–3.3e-3 in gradients, rounding as a GPU does; 1.2e-2 while the interpreter truncated)
TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-3, torch.float16: 1e-3}  # fp16: 2.0e-4 values, 2.8e-4–4.3e-4 grads
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # float16: `vitconvert bench --amp float16`, autocast fp16


def assert_matches_oracle(out, inputs, oracle, tol: float, grad_tol: Optional[float] = None):
    """``out`` (computed from ``inputs``) against ``oracle`` run on float64 copies of them: values within ``tol``,
    the gradients of every input within ``grad_tol`` (2 × tol by default). Returns the kernels' gradients."""
    copies = [t.detach().double().requires_grad_() for t in inputs]
    expected = oracle(*copies)
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, inputs, grad.to(out.dtype))
    want = torch.autograd.grad(expected, copies, grad)
    assert rel_error(out, expected) < tol
    for g, w in zip(got, want, strict=True):
        assert rel_error(g, w) < (2 * tol if grad_tol is None else grad_tol)
    return got

def explicit_lepe(v, weight, bias, key_valid, grid, prefix):
    """The depthwise conv of the masked v on the grid as an explicit sum over zero-padded shifts (prefix: 0)."""
    B, H, N, d = v.shape
    size = weight.shape[-1]
    spatial = v[:, :, prefix:] * (1.0 if key_valid is None else key_valid[:, None, prefix:, None].to(v.dtype))
    image = spatial.transpose(1, 2).reshape(B, *grid, H * d)
    padded = torch.nn.functional.pad(image, (0, 0, size // 2, size // 2, size // 2, size // 2))
    out = bias.expand_as(image)
    for i in range(size):
        for j in range(size):
            out = out + padded[:, i:i + grid[0], j:j + grid[1]] * weight[:, 0, i, j]
    out = out.reshape(B, N - prefix, H, d).transpose(1, 2)
    return torch.cat((torch.zeros_like(v[:, :, :prefix]), out), dim=2)


ORACLES = {
    "elu": (fused.ELU_PLUS_ONE, elu_feature_literal),
    "relu": (fused.RELU, relu_feature),
}


def make_module(name: str, head_dim: int, grid, num_prefix: int, **options):
    module = helpers.make_module(name, num_prefix, grid, dim=2 * head_dim, dtype=torch.float32, **options)
    if name == "mhla":  # W away from its symmetric init, so a transposed mixing would show
        with torch.no_grad():
            module.block_mix.add_(torch.rand(module.block_mix.shape, generator=torch.Generator().manual_seed(1)))
    return module.to(DEVICE)


SPLIT_BACKWARD_KERNELS = ("readout_bwd_kernel", "state_bwd_kernel")  # (heads split over programs; MHLA's blocked op)
BACKWARD_KERNELS = (*SPLIT_BACKWARD_KERNELS, "attention_bwd_kernel")  # (a head in one program: ELU, ReLU, InLine)


def launches_and_ops(forward, inputs: tuple) -> tuple[dict[str, list[str]], torch.Tensor, torch.Tensor, tuple]:
    """(the aten ops and Triton launches by name of ``forward()`` and of its backward to ``inputs``, each direction
    recorded alone; out; the output gradient; the inputs' gradients): the ops' bodies called direct, as without the
    recording mode (host_overhead.py counts so), the interpreter's own copies inside a launch left out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    events: list[str] = []
    launching = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not launching:
                events.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    def count(kernel, grid, *args, **kwargs):
        events.append(dispatch.kernel_name(kernel))
        launching.append(True)
        try:
            return dispatch.build_and_run(kernel, grid, *args, **kwargs)
        finally:
            launching.pop()

    runs = {}
    with dispatch.launches_through(count, DEVICE), dispatch.kernels_on(direct_under_modes=True):
        with Ops():
            out = forward()
        runs["forward"] = list(events)
        events.clear()
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE, out.dtype)  # (no cast
        # by autograd in the recorded backward)
        with Ops():
            grads = torch.autograd.grad(out, inputs, grad)
        runs["backward"] = list(events)
    return runs, out, grad, grads


ALLOCATIONS = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "transpose", "view", "slice",
               "select"}  # (and views: the aten ops that move no data)
