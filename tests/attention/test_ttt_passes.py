"""TTT's step in few passes over the tokens: the GPU's one-reduction key norm, the bf16 form's gradients, and the
count of token-sized ops (benchmarks/op_traffic.py, dry-run here)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import load_benchmark
from torch.nn import functional as F

from vitconvert.attention.ops import dispatch
from vitconvert.attention.ttt import normalize_keys

from .helpers import make_module, random_mask, random_qkv


def op_traffic():
    return load_benchmark("op_traffic")


def test_the_one_reduction_key_norm_is_the_instance_norm_values_and_gradients():
    k = torch.randn(2, 3, 10, 4, dtype=torch.float64).mul(3.0).add(5.0).requires_grad_()  # a mean to take out
    expected = F.instance_norm(k.permute(0, 1, 3, 2).reshape(2, 12, 10), eps=1.0).reshape(2, 3, 4, 10)
    expected = expected.permute(0, 1, 3, 2)
    probe = torch.randn_like(k)
    grads = []
    for by_var_mean in (True, False):
        out = normalize_keys(k, None, 1.0, by_var_mean=by_var_mean)
        torch.testing.assert_close(out, expected)
        grads.append(torch.autograd.grad((out * probe).sum(), k)[0])
    torch.testing.assert_close(*grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_fused_paths_key_norm_is_the_instance_norm_values_and_gradients(dtype):
    """lean_norms.key_instance_norm (TTT's fused path: float32 statistics read from bf16 keys, no float32 copy;
    a Function whose backward recomputes x̂) against F.instance_norm in float64, within k's rounding; the no-grad
    form gives the Function's values bitwise."""
    from vitconvert.attention.ops.norms.lean import key_instance_norm

    k64 = torch.randn(2, 3, 50, 8, dtype=torch.float64).mul(3.0).add(5.0)  # a mean to take out
    k = k64.to(dtype).requires_grad_()
    ref_in = k.detach().double().requires_grad_()
    expected = F.instance_norm(ref_in.permute(0, 1, 3, 2).reshape(2, 24, 50), eps=1.0).reshape(2, 3, 8, 50)
    expected = expected.permute(0, 1, 3, 2)
    out = key_instance_norm(k, None, 1.0, dtype)
    assert out.dtype == dtype
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-6
    assert rel_error(out, expected) < tol
    probe = torch.randn(2, 3, 50, 8, dtype=torch.float64)
    (got,) = torch.autograd.grad((out.double() * probe).sum(), k)
    (want,) = torch.autograd.grad((expected * probe).sum(), ref_in)
    assert rel_error(got, want) < 2 * tol
    with torch.no_grad():
        assert torch.equal(key_instance_norm(k, None, 1.0, dtype), out.detach())


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_bf16_form_has_the_float32_gradients_within_bf16_rounding(masked):
    mod = make_module("ttt", 1, (4, 4), dim=64, heads=2, dtype=torch.float32, inner_lr=1.0)  # (weights > init)
    with torch.no_grad():
        for w in (mod.fast_w1, mod.fast_w2, mod.fast_w3):
            w.normal_(std=0.3)
    key_valid = random_mask(2, 17) if masked else None
    probe = torch.randn(2, 2, 17, 32)
    params = [mod.fast_w1, mod.fast_w2, mod.fast_w3, mod.q_conv.weight, mod.k_conv.weight]
    results = []
    for dtype, form in ((torch.float32, mod.step), (torch.bfloat16, mod.bf16_mix)):
        q, k, v = (t.to(dtype).requires_grad_() for t in random_qkv(2, 2, 17, 32, dtype=torch.float32))
        out = form(q, k, v, key_valid, (4, 4))
        results.append((out, *torch.autograd.grad((out.float() * probe).sum(), [q, k, v, *params])))
    for half, exact in zip(*results, strict=True):
        assert torch.isfinite(half).all() and rel_error(half, exact) < 2e-2  # 7e-3 to 1.2e-2 here, as before the cuts


@pytest.mark.parametrize("train", [False, True], ids=["forward", "training-step"])
def test_op_traffic_reports_softmax_the_model_and_its_token_mixing(train, capsys):
    argv = ["--model", "vit_tiny_patch16_224", "--img-size", "32", "--depth", "1", "--batch", "1", "--by-op"]
    devices = dispatch.current().devices
    assert op_traffic().main(argv + (["--train"] if train else [])) == 0
    assert dispatch.current().devices == devices  # the GPU path on the CPU is not left on for the rest of the process
    out = capsys.readouterr().out
    assert ("aten ops of a training step" in out) == train, out
    model = r"model \d+ ops \(\d+ token-sized\), [\d.]+ MiB"
    for form in ("float32", "bf16 GPU path"):
        assert re.search(rf"^  softmax, {form}: {model}$", out, re.M), out
        assert re.search(rf"^  ttt, {form}: {model}; token mixing's forward per layer \d+ ops \(\d+ token-sized\)",
                         out, re.M), out
    assert re.search(r"^ +bmm +[\d.]+× \( *[\d.]+ token-sized\) +[\d.]+ MiB$", out, re.M), out
    # the kernels' own traffic, which the fused op's inputs and outputs do not show (its d×d states)
    assert re.search(r"^    inside its fused ops: \d+ Triton launches, [\d.]+ MiB of their tensor arguments$", out,
                     re.M), out
    assert op_traffic().main(["--variant", "nope"]) == 2


# Token-sized passes of TTT's step (more tokens than channels, so only the N-sized ops count). float32, the CPU's
# eager form: the key norm (five sums-form passes), two convs and two concatenations with the prefix, v made
# contiguous once, seven matmuls, a and b's sigmoid, silu, the silu' lerp and four products, the read-out's silu
# and product (29 before the last cuts). bf16, the GPU path: none as torch ops; the fused op's launch (the step,
# its keys' statistics taken first, with the key norm and both convs applied as it loads its tiles) is
# test_mixing_passes.py's (8 torch ops before they moved into the op, 25 before the op).
TOKEN_SIZED_PASSES = {"float32": 26, "bf16": 0}


@pytest.mark.parametrize("class_token", [True, False], ids=["class-token", "no-prefix"])
def test_the_step_runs_no_more_token_sized_passes_than_its_budget(class_token, kernels_on_the_cpu):
    import timm

    import vitconvert

    script = op_traffic()
    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=8, embed_dim=48,
                               num_heads=3, depth=1, class_token=class_token,
                               global_pool="token" if class_token else "avg")
    student, _ = vitconvert.convert(source, "ttt")
    images = torch.randn(2, 3, 64, 64)
    token_sized = 2 * 48 * 64  # q's elements on the 8×8 grid; the head dim is 16
    # (the kernels_on_the_cpu fixture: the bf16 form, which a GPU runs)
    for form, budget in TOKEN_SIZED_PASSES.items():
        passes = script.count(student, images, form, token_sized).mixing.token_sized
        assert passes <= budget, (form, passes)
