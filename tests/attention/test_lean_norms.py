"""The norms MHLA and TTT write out for memory (vitconvert/attention/ops/norms/lean.py): their backwards are torch's
fused norm kernels, so a training step makes a few passes over N×C, not a dozen float32 ones. Counted with
benchmarks/op_traffic.py's recorder; the values and gradients themselves are tested in test_mhla.py and
test_ttt_passes.py."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import load_benchmark
from torch import nn

from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.norms import lean as lean_norms
from vitconvert.attention.ops.norms.reference import rms_norm_over_heads as rms_over_heads

from .helpers import cuda_rms_kernel_on_the_cpu, rel_error

B, N, H, D = 2, 197, 3, 16  # N×C tokens (more than the qkv weight's 3C×C), C = H·D


@pytest.fixture
def cuda_rms_kernel():
    """The CUDA branch of rms_over_heads_backward taken on the CPU, the kernel's math registered for the CPU;
    yields the list of its calls."""
    if not lean_norms.FUSED_RMS_BACKWARD:
        pytest.skip("this torch has no aten::_fused_rms_norm_backward")
    with cuda_rms_kernel_on_the_cpu() as calls:
        yield calls


def qk_of_a_qkv_output(seed: int = 0) -> torch.Tensor:
    """bf16 (B, H, N, d) q as the layer has it: a strided view of the qkv projection's (B, N, 3, H, d) output."""
    qkv = torch.randn(B, N, 3, H, D, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return qkv[:, :, 0].transpose(1, 2)


def test_on_cuda_the_rmsnorm_backward_is_torchs_fused_kernel(cuda_rms_kernel):
    """Half q and k on CUDA take torch's fused RMSNorm backward (one kernel, where the formula written out is ~13
    passes over N×C float32): the branch's gradients within bf16 rounding of float64 autograd."""
    g = torch.Generator().manual_seed(1)
    t, weight = qk_of_a_qkv_output(), 1 + torch.rand(H * D, generator=g)
    grad = torch.randn(B, H, N, D, generator=g).bfloat16()
    t64, w64 = t.double().requires_grad_(), weight.double().requires_grad_()
    want = torch.autograd.grad(rms_over_heads(t64, w64), (t64, w64), grad.double())
    got = lean_norms.rms_over_heads_backward(t, weight, 1e-6, grad)
    assert len(cuda_rms_kernel) == 1
    assert got[0].shape == t.shape and got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    for mine, exact in zip(got, want, strict=True):
        assert rel_error(mine, exact) < 8e-3


def token_sized_ops(step) -> int:
    """Ops of ``step`` that touch a tensor of N×C elements or more (op_traffic's recorder)."""
    recorder = load_benchmark("op_traffic").OpTraffic(B * N * H * D)
    with recorder:
        step()
    return recorder.model.token_sized


def test_the_layernorm_and_qkv_backward_is_a_few_passes():
    """Its y recomputed (one addcmul), the linear's two matmuls, the bias's sum, dy and x − μ in float32 (two
    passes) and torch's LayerNorm backward: 7 token-sized ops (the formula written out took 18)."""
    x = torch.randn(B, N, H * D, requires_grad=True)
    norm, linear = nn.LayerNorm(H * D), nn.Linear(H * D, 3 * H * D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lean_norms.layer_norm_linear(x, norm, linear.weight, linear.bias)
    grad = torch.randn_like(out)
    assert token_sized_ops(lambda: out.backward(grad)) <= 7


def test_the_rmsnorm_backward_on_cuda_is_a_few_passes(cuda_rms_kernel):
    """q's rows copied (a view of qkv: the kernel wants them contiguous), its norm, the gradient in q's layout,
    and the kernel: 4 token-sized ops (15 on the formula, which the CPU keeps)."""
    t, grad = qk_of_a_qkv_output(), torch.randn(B, H, N, D).bfloat16()
    assert token_sized_ops(lambda: lean_norms.rms_over_heads_backward(t, torch.ones(H * D), 1e-6, grad)) <= 4
    assert len(cuda_rms_kernel) == 1


def test_the_recomputed_rmsnorm_hands_its_rows_and_rstd_to_the_backward(cuda_rms_kernel):
    """MHLA's backward recomputes q's RMSNorm with torch's fused forward (as F.rms_norm runs on CUDA), which
    gives the contiguous rows and rstd the fused backward reads: that backward is then the kernel alone (the
    gradient arrives tokens-major from the blocked op's backward, a view), where recomputing them took three
    token-sized passes; values and gradients as without them."""
    g = torch.Generator().manual_seed(2)
    t, weight = qk_of_a_qkv_output(), 1 + torch.rand(H * D, generator=g)
    normed, saved = lean_norms.rms_recomputed(t, weight, 1e-6)
    assert saved is not None and rel_error(normed, rms_over_heads(t.double(), weight.double())) < 8e-3
    grad = torch.randn(B, N, H, D, generator=g).bfloat16().transpose(1, 2)  # (the fused backwards' layout)
    assert token_sized_ops(lambda: lean_norms.rms_over_heads_backward(t, weight, 1e-6, grad, saved)) == 1
    with_saved = lean_norms.rms_over_heads_backward(t, weight, 1e-6, grad, saved)
    for mine, again in zip(with_saved, lean_norms.rms_over_heads_backward(t, weight, 1e-6, grad), strict=True):
        assert rel_error(mine, again) < 8e-3
    assert lean_norms.rms_recomputed(t.float(), weight, 1e-6)[1] is None  # float32: the formula, nothing kept


def test_mhlas_blocked_op_takes_its_rmsnorm_backward_in_its_kernels(cuda_rms_kernel):
    """The blocked op normalises q and k in its kernels both ways: a training step on the CUDA branch calls no torch
    RMSNorm backward and runs two launches forward (each token's 1/rms over heads of q and k taken in them) and three
    backward (counted, not run: the values and gradients are test_fused.py's and test_split_launches.py's)."""
    from vitconvert.attention.blocks import extended_block_mix, segment_index
    from vitconvert.attention.ops.linear import op as fused

    g = torch.Generator().manual_seed(4)
    qkv_out = torch.randn(B, 37, 3, H, D, generator=g).bfloat16().requires_grad_()  # a prefix token, a 6×6 grid
    q, k, v = (t.transpose(1, 2) for t in qkv_out.unbind(2))
    weights = [(1 + torch.rand(H * D, generator=g)).requires_grad_() for _ in range(2)]
    mixing = extended_block_mix(torch.rand(4, 4, generator=g)).requires_grad_()
    launched = []
    with dispatch.launches_through(lambda kernel, *_, **__: launched.append(dispatch.kernel_name(kernel)), "cpu"):
        out = fused.segmented_attention(q, k, v, None, segment_index((6, 6), (2, 2), 1, q.device), mixing,
                                        fused.RELU_PLUS_EPS, 1e-6, 1e-6, *weights, 1e-6)
        torch.autograd.grad(out.float().sum(), [qkv_out, mixing, *weights])
    assert launched == ["state_fwd_kernel", "readout_fwd_kernel", "state_fwd_kernel",
                        "readout_bwd_kernel", "state_bwd_kernel"]
    assert not cuda_rms_kernel


def test_ttts_key_norm_backward_is_a_few_passes():
    """The gradient's and the keys' rows in float32 (two copies), torch's LayerNorm backward over the tokens, dk
    back in bf16: 4 token-sized ops (the formula written out took 12)."""
    k = qk_of_a_qkv_output().requires_grad_()
    out = lean_norms.key_instance_norm(k, None, 1.0, torch.bfloat16)
    grad = torch.randn_like(out)
    assert token_sized_ops(lambda: torch.autograd.grad(out, k, grad)) <= 4


def test_op_traffic_counts_cudas_fused_rmsnorm_as_one_op_each_way(capsys, monkeypatch):
    """``op_traffic.py --cuda-norms``: MHLA's RMSNorm as on CUDA (torch's fused ops, which the CPU lacks, stood in),
    the CPU stand-ins gone afterwards. Both MHLA forms normalise q and k in their kernels both ways, so the blocked
    form's counts are the same with and without them (a torch norm back in its path would differ); the launches
    counted, not run."""
    if not lean_norms.FUSED_RMS_BACKWARD:
        pytest.skip("this torch has no aten::_fused_rms_norm_backward")
    script = load_benchmark("op_traffic")
    argv = ["--variant", "mhla", "--model", "test_vit", "--img-size", "32", "--depth", "1", "--batch",
            "1", "--train", "--sizes-only"]
    counted = {}
    for flag in ([], ["--cuda-norms"]):
        with dispatch.kernels_on(settings=dispatch.KernelSettings(form="blocked")):
            assert script.main(argv + flag) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  mhla, bf16 GPU path"))
        assert ("CUDA's fused RMSNorm" in line) == bool(flag), line
        ops, mib = re.search(r"model (\d+) ops .*?, ([\d.]+) MiB", line).groups()
        counted[bool(flag)] = int(ops), float(mib)
    assert counted[True] == counted[False], counted
    assert dispatch.current().rms_norm_devices == ("cuda",)
    x = torch.randn(2, 8).bfloat16()
    rstd = torch.ones(2, 1)
    with pytest.raises(NotImplementedError):  # the CPU kernel registered for the count is removed again
        torch.ops.aten._fused_rms_norm_backward(x, x, [8], rstd, torch.ones(8).bfloat16(), [True, True])
