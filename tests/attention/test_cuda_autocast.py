"""The fused paths under CUDA's autocast policy, stood in on the CPU (tests/helpers.py: cuda_autocast_policy).

CUDA's autocast casts more ops to float32 than the CPU's (F.rms_norm, sum, pow, rsqrt, layer_norm…) and promotes
addcmul's inputs, so a forward every other test sees in bf16 can run partly in float32 on a GPU. MHLA's did: its
RMSNorm of q and k inside the blocked op came out float32, so its kernels read q and k as float32 tiles and wrote a
float32 output where the op's fake (torch.compile's view of it) says bf16. Here each variant's training step on the
kernels (Triton's interpreter) must be the same under both policies: the same tensors' dtypes reach every launch,
the outputs and gradients are bitwise equal, and each op returns the dtype, shape and strides its fake says.
"""

from __future__ import annotations

import contextlib

import pytest
import timm
import torch
from helpers import FAMILIES, cuda_autocast_policy, image_batch, tiny_model
from torch.nn import functional as F

import vitconvert
from vitconvert.attention.ops import calls, dispatch
from vitconvert.attention.ops.norms import lean as lean_norms

from .helpers import cuda_rms_kernel_on_the_cpu

pytest.importorskip("triton")
if torch.cuda.is_available() or not dispatch.interpreting():
    pytest.skip("CPU only: the CPU's autocast key stands in for CUDA's", allow_module_level=True)


def test_the_stand_in_casts_as_cudas_autocast_does():
    x, w = torch.randn(2, 8).bfloat16(), torch.ones(8)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.rms_norm(x, (8,)).dtype == torch.float32  # float32 list
        assert x.sum().dtype == x.sum(dim=0).dtype == torch.float32  # float32 unless a dtype is given
        assert x.sum(dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.addcmul(x, x, w).dtype == torch.float32  # promoted to the widest input
        assert torch.addcmul(x, x, x, out=torch.empty_like(x)).dtype == torch.bfloat16  # out= ops are not cast
        assert torch.einsum("ij,kj->ik", w[None], w[None]).dtype == torch.bfloat16  # lower precision
        assert (x.float() @ w).dtype == torch.bfloat16  # the CPU's own casts stay
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.rms_norm(x, (8,)).dtype == x.sum().dtype == torch.bfloat16  # removed again: the CPU's policy


def training_step(model: torch.nn.Module, images: torch.Tensor, cuda_policy: bool, dtype: torch.dtype):
    """(launches' kernel names and tensor dtypes, logits, every parameter's gradient) of one step in ``dtype``
    autocast."""
    launches = []

    def launch(kernel, grid, *args, **kwargs):
        dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
        launches.append((getattr(kernel, "__name__", str(kernel)), dtypes))
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    model.zero_grad(set_to_none=True)
    with dispatch.launches_through(launch, "cpu"):
        with (cuda_autocast_policy() if cuda_policy else torch.autocast("cpu", enabled=True)):
            with torch.autocast("cpu", dtype=dtype):
                logits = model(images)
        logits.float().square().mean().backward()
    return launches, logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant,head_dim", [("elu", 32), ("relu", 32), ("inline", 32), ("mhla", 32),
                                              ("mhla-blocked", 32), ("ttt", 32), ("ttt", 96)])
def test_a_training_step_is_the_same_under_cudas_autocast(monkeypatch, variant, head_dim, dtype):
    """mhla-blocked: MHLA's blocked form, torch's RMSNorm on its CUDA branch (its fused kernels), which the form no
    longer calls (the norm in its kernels both ways; the plain mhla case takes the pairwise form); ttt at head dim
    96: TTT's torch bf16 form (its kernels take head dims up to 64; in fp16 its float32 form). fp16: `--amp
    float16`."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(dispatch.kernels_on("cpu"))
        differ = stack.enter_context(calls.fakes_checked())
        rms_backward_calls = None
        if variant == "mhla-blocked":
            if not lean_norms.FUSED_RMS_BACKWARD:
                pytest.skip("this torch has no aten::_fused_rms_norm_backward")
            variant, rms_backward_calls = "mhla", stack.enter_context(cuda_rms_kernel_on_the_cpu())
            dispatch.current().settings = dispatch.KernelSettings(form="blocked")
        torch.manual_seed(0)
        source = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=64, depth=1,
                                   embed_dim=2 * head_dim, num_heads=2)
        student, _ = vitconvert.convert(source, variant)
        images = torch.randn(1, 3, 64, 64)  # one image: the interpreter runs each program in turn
        launches, logits, grads = training_step(student, images, False, dtype)
        on_cuda = training_step(student, images, True, dtype)
    assert (head_dim == 96 and variant == "ttt") or launches, "the step ran no kernels"
    assert rms_backward_calls is None or not rms_backward_calls
    assert not differ, differ  # each op returns what its fake says, under both policies
    assert on_cuda[0] == launches  # the same kernels, given tensors of the same dtypes
    assert on_cuda[1].dtype == logits.dtype and torch.equal(on_cuda[1], logits)
    assert on_cuda[2].keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(on_cuda[2][name], grad), name


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_forwards_the_same_under_cudas_autocast(family, kernels_on_the_cpu):
    """Every timm family the surgery takes, each variant on the kernels, a training forward and backward: the
    output bitwise the same under both policies and every op as its fake says. (The gradients may differ where timm's
    own parts norm bf16 tensors, q/k norms or an attention-pool head: CUDA's autocast runs those norms in float32.)"""
    source = tiny_model(family)
    images = image_batch(source)
    for variant in ("elu", "inline", "mhla", "ttt"):
        student, _ = vitconvert.convert(source, variant)
        outputs = []
        with calls.fakes_checked() as differ:
            for cuda_policy in (False, True):
                with (cuda_autocast_policy() if cuda_policy else torch.autocast("cpu", enabled=True)):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        out = student.train()(images)
                out = out[0] if isinstance(out, (tuple, list)) else out
                out.float().square().mean().backward()
                outputs.append(out.detach())
        assert not differ, (variant, differ)
        assert torch.equal(*outputs), variant
