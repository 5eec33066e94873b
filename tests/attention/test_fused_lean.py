"""Launch settings on GPUs other than the H200 they were made for. Kernels that do not fit a GPU on their call
site's settings run on leaner ones (dispatch.launch): 16-bit tiles for half inputs, then smaller token chunks,
chosen once per kernel; the answers stay the N×N forms' within the same bars. Where ptxas builds a kernel badly
for one generation, that build takes other ptxas options (dispatch.build_options). Which settings fit which GPU
generation: benchmarks/kernel_resources.py --arch (tests/attention/test_kernel_resources.py builds them)."""

from __future__ import annotations

import warnings

import pytest
import torch

from vitconvert.attention import dispatch, fused
from vitconvert.attention.inline import inline_weights
from vitconvert.attention.kernel import kernel_attention_reference

from . import helpers
from .test_fused import DEVICE, ORACLES, TOL, assert_matches_oracle, kernels_here, make_module, padding_mask, qkv

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

__all__ = ["kernels_here"]  # (the autouse fixture: the kernels on this machine's device)
BACKWARD_KERNELS = ("readout_bwd_kernel", "state_bwd_kernel")


@pytest.fixture(autouse=True)
def fresh_dispatch(monkeypatch):
    monkeypatch.setattr(dispatch, "_settled", {})
    monkeypatch.setattr(dispatch, "_unavailable", {})


def l40_at_head_dim_128(settings: dict) -> bool:
    """What fits the read-out's and state's backward at head dim 128 on an L40 (99 KB a block): 16-bit tiles and
    16-token chunks (benchmarks/kernel_resources.py --arch sm_89 --head-dims 128)."""
    return settings["TILE"] != tl.float32 and settings["BLOCK_N"] <= 16


def cramp(monkeypatch, fits, kernels=BACKWARD_KERNELS) -> dict[str, helpers.Cramped]:
    from vitconvert.attention import triton_kernels

    cramped = {name: helpers.Cramped(getattr(triton_kernels, name), fits) for name in kernels}
    for name, kernel in cramped.items():
        monkeypatch.setattr(triton_kernels, name, kernel)
    return cramped


def test_the_ladder_takes_16_bit_tiles_then_halves_the_chunk():
    bf16_tf32 = {"BLOCK_N": 64, **dispatch._tile_args(torch.bfloat16, False, "tf32", False)}
    assert dispatch.leaner(bf16_tf32, torch.bfloat16) == {"TILE": tl.bfloat16, "PRECISION": "ieee"}
    fp16_tf32 = {"BLOCK_N": 64, **dispatch._tile_args(torch.float16, False, "tf32", False)}
    assert dispatch.leaner(fp16_tf32, torch.float16) == {"TILE": tl.float16, "PRECISION": "ieee"}
    half = {**bf16_tf32, "TILE": tl.bfloat16, "PRECISION": "ieee"}
    assert dispatch.leaner(half, torch.bfloat16) == {"BLOCK_N": 32}
    assert dispatch.leaner({**half, "BLOCK_N": 16}, torch.bfloat16) is None
    # float32 inputs keep the dots' precision the user chose (TF32 or not): only the chunk shrinks
    fp32 = {"BLOCK_N": 32, **dispatch._tile_args(torch.float32, True, "tf32", False)}
    assert dispatch.leaner(fp32, torch.float32) == {"BLOCK_N": 16}


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("name", ["elu", "inline"])
def test_backward_kernels_too_big_for_the_gpu_run_lean_within_the_bf16_bar(name, masked, monkeypatch):
    """bf16 q, k, v; the backward kernels fit only on 16-bit tiles and 16-token chunks: no warning, the kernels
    still run (no eager fallback), and values and gradients keep the N×N form's bf16 bar."""
    cramped = cramp(monkeypatch, l40_at_head_dim_128)
    mask = padding_mask(2, 150) if masked else None
    q, k, v = qkv(N=150, d=64, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if name == "inline":
            out = fused.inline_attention(q, k, v, mask, 64 ** -0.5)
            assert_matches_oracle(out, (q, k, v), lambda q, k, v: inline_weights(q, k, mask, 64 ** -0.5) @ v,
                                  TOL[torch.bfloat16])
        else:
            feature, phi = ORACLES[name]
            out = fused.kernel_attention(q, k, v, mask, feature, 1e-6)
            assert_matches_oracle(out, (q, k, v), lambda q, k, v: kernel_attention_reference(
                phi(q), phi(k), v, mask, 1e-6), TOL[torch.bfloat16])
    assert fused.can_run(q, "linear_attention")  # nothing turned off
    # the first launch of each tried TF32 tiles, then 64- and 32-token chunks; the rest took what fitted
    assert {n: c.refused for n, c in cramped.items()} == {n: 3 for n in BACKWARD_KERNELS}
    assert dispatch.lean_launches() == {n: {"TILE": tl.bfloat16, "PRECISION": "ieee", "BLOCK_N": 16}
                                        for n in BACKWARD_KERNELS}
    out = fused.kernel_attention(q, k, v, mask, fused.ELU_PLUS_ONE, 1e-6) if name != "inline" else (
        fused.inline_attention(q, k, v, mask, 64 ** -0.5))
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert {n: c.refused for n, c in cramped.items()} == {n: 3 for n in BACKWARD_KERNELS}  # remembered


def test_an_mhla_module_on_float32_takes_smaller_chunks_and_matches_its_reference(monkeypatch):
    """Float32 inputs keep their tiles (the dots' precision is the user's TF32 switch); a GPU where every kernel
    fits only with 16-token chunks runs them all at 16, the whole module within its float32 bars."""
    from vitconvert.attention import triton_kernels

    kernels = [n for n in dir(triton_kernels) if n.endswith("_kernel")]
    cramped = cramp(monkeypatch, lambda settings: settings["BLOCK_N"] <= 16, kernels)
    module = make_module("mhla", 32, (6, 7), 1, blocks_per_side=2)
    x = torch.randn(2, 43, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        errors = helpers.float32_against_literal(module, x, padding_mask(2, 43)[:, None, None, :])
    assert errors.pop("output") < 1e-5
    assert not {n: e for n, e in errors.items() if e >= {"block_mix": 1e-3}.get(n, 1e-4)}, errors
    launched = {n for n, c in cramped.items() if c.refused}
    assert launched >= {"state_fwd_kernel", "readout_fwd_kernel", *BACKWARD_KERNELS}
    assert all(step == {"BLOCK_N": 16} for step in dispatch.lean_launches().values())


def test_a_kernel_that_fits_no_settings_still_falls_back_to_eager_once(monkeypatch):
    """Past the last step (16-bit tiles, 16 tokens) the op's kernels turn off with one warning, as before."""
    cramped = cramp(monkeypatch, lambda settings: False)
    q, k, v = qkv(N=150, d=64, dtype=torch.bfloat16)
    out = fused.kernel_attention(q, k, v, None, fused.ELU_PLUS_ONE, 1e-6)
    with pytest.warns(RuntimeWarning, match="OutOfResources"):
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not fused.can_run(q, "linear_attention")
    assert sum(c.refused for c in cramped.values()) == 4  # TF32 64, then 16-bit tiles at 64, 32, 16: one kernel


def test_ttt_sums_backward_is_built_with_ptxas_o1_for_an_a100_only(monkeypatch):
    """ptxas -O3 gives TTT's sums' backward 32 registers and 2,208 registers' worth of spills on sm_80 (388 with
    -O1; tests/attention/test_kernel_resources.py builds both): the option for that kernel on that generation."""
    monkeypatch.delenv("PTXAS_OPTIONS", raising=False)
    cpu = torch.device("cpu")
    assert dispatch.build_options("inner_sums_bwd_kernel", cpu) == {}  # (no GPU generation here)
    with dispatch.launches_through(lambda *a, **k: None, "cpu", capability=(8, 0)):
        assert dispatch.build_options("inner_sums_bwd_kernel", cpu) == {"ptx_options": "--opt-level 1"}
        assert dispatch.build_options("swiglu_readout_bwd_kernel", cpu) == {}
        monkeypatch.setenv("PTXAS_OPTIONS", "--verbose")  # the user's own options to Triton's ptxas win
        assert dispatch.build_options("inner_sums_bwd_kernel", cpu) == {}
    for generation in ((8, 6), (8, 9), (9, 0), (10, 0)):
        with dispatch.launches_through(lambda *a, **k: None, "cpu", capability=generation):
            assert dispatch.build_options("inner_sums_bwd_kernel", cpu) == {}
