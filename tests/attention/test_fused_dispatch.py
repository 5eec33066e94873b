"""The fused kernels' dispatch: where they run and where the eager form does, the settings read from the
environment and what reaches the launches, older Tritons' halved chunks, and the lean settings that GPUs other
than the H200 the launches were made for need (in Triton's interpreter without a GPU, as test_fused.py)."""

from __future__ import annotations

import pytest
import torch

from vitconvert.attention.ops import dispatch, launch_plan
from vitconvert.attention.ops.linear import op as fused
from vitconvert.attention.ops.linear.reference import inline_weights, kernel_attention_reference
from vitconvert.errors import VitconvertError

from . import helpers
from .fused_cases import (
    BACKWARD_KERNELS,
    DEVICE,
    ORACLES,
    SPLIT_BACKWARD_KERNELS,
    TOL,
    assert_matches_oracle,
    kernels_here,  # noqa: F401  (an autouse fixture: the kernels on this device)
    make_module,
    padding_mask,
    qkv,
    tl,
)


def test_dispatch_is_eager_where_the_kernels_cannot_go():
    """CPU tensors (outside these tests), head dims outside 16..128, int tensors, ONNX export: the eager form."""
    with dispatch.kernels_on(devices=("cuda",)):
        assert not dispatch.can_run(torch.zeros(1, 1, 4, 64), "linear_attention")
    with dispatch.kernels_on("cpu"):
        assert dispatch.can_run(torch.zeros(1, 1, 4, 64), "linear_attention")
    assert not dispatch.can_run(torch.zeros(1, 1, 4, 8), "linear_attention")
    assert not dispatch.can_run(torch.zeros(1, 1, 4, 256), "linear_attention")
    assert not dispatch.can_run(torch.zeros(1, 1, 4, 64, dtype=torch.float64), "linear_attention")


@pytest.mark.parametrize("generation,fused_here", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 9), True),
                                                   ((9, 0), True), ((10, 0), True)])
def test_gpus_before_ampere_run_the_eager_form(generation, fused_here, monkeypatch):
    """A V100 or T4: the kernels built for them spill 400–2,000 registers' worth (benchmarks/kernel_resources.py
    --arch sm_75), so their tensors take the eager form; Ampere on, the kernels. (This machine's tensors stand in
    for a GPU's: its device type is checked as CUDA's is.)"""
    x = torch.zeros(1, 1, 4, 64, device=DEVICE)
    dispatch.current().generation_checked = (x.device.type,)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: generation)
    assert dispatch.can_run(x, "linear_attention") is fused_here
    with dispatch.kernels_on(ttt_dtypes=(torch.float32,)):
        assert dispatch.can_run(x, "ttt_step") is fused_here


def test_the_switch_is_read_once_at_construction(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "0")
    off = make_module("elu", 32, (4, 4), 1)
    monkeypatch.setenv(dispatch.ENV, "1")
    on = make_module("elu", 32, (4, 4), 1)
    assert not off.fused_kernels and on.fused_kernels
    calls = []
    x = torch.randn(1, 17, 64, device=DEVICE)
    with dispatch.kernels_on(launcher=lambda *a, **k: calls.append(a)):
        off(x)  # the eager form: never reaches the kernels
    assert calls == []


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("False", False), ("no", False), ("1", True),
                                       ("on", True), ("TRUE", True), ("", True), (" 0 ", False)])
def test_the_switch_takes_the_usual_spellings(monkeypatch, value, on):
    monkeypatch.setenv(dispatch.ENV, value)
    assert make_module("elu", 32, (4, 4), 1).fused_kernels is on


@pytest.mark.parametrize("name, value", [("VITCONVERT_FUSED", "maybe"), ("VITCONVERT_FUSED", "2"),
                                         ("VITCONVERT_FUSED_TILE", "bf16"), ("VITCONVERT_FUSED_CONFIG", "64"),
                                         ("VITCONVERT_FUSED_CONFIG", "33,4"), ("VITCONVERT_FUSED_CONFIG", "64,3"),
                                         ("VITCONVERT_FUSED_CONFIG", "a,b"), ("VITCONVERT_FUSED_CONFIG", "8,4")])
def test_a_bad_setting_is_refused_at_construction_not_ignored(monkeypatch, name, value):
    """``VITCONVERT_FUSED=false`` used to mean on (anything but "0"); a typo in the tuning variables failed deep in
    a launch or fell back to the default silently. Now any of them is a one-line error before a model is made."""
    monkeypatch.setenv(name, value)
    with pytest.raises(VitconvertError, match=f"^{name}='{value}': expected"):
        make_module("elu", 32, (4, 4), 1)


def test_the_tuning_settings_reach_the_launches():
    settings = dispatch.KernelSettings.read({dispatch.CONFIG_ENV: "128,16", dispatch.TILE_ENV: " Half "})
    with dispatch.kernels_on(settings=settings):
        assert dispatch.block_sizes(64) == (128, 64, 16)
        launches = launch_plan.linear_launches(torch.zeros(1, 1, 1, 64), 1, 1, 1, False)
        assert (launches.block_n, launches.warps) == (128, 16)
        assert launches.stages == dispatch.KernelSettings().stages == 2  # (none given: the default)
        assert dispatch.tile_args(torch.zeros(1, dtype=torch.bfloat16))["PRECISION"] == "ieee"  # 16-bit tiles
    with dispatch.kernels_on(settings=dispatch.KernelSettings(tile="tf32")):
        assert dispatch.tile_args(torch.zeros(1, dtype=torch.bfloat16))["PRECISION"] == "tf32"


@pytest.mark.parametrize("variant", ["elu", "inline"])
def test_num_stages_reaches_every_launch_of_the_linear_ops(monkeypatch, variant):
    """``VITCONVERT_FUSED_CONFIG``'s third number is the pipeline depth (num_stages) of the ELU/ReLU/InLine kernels,
    one launch and split, forward and backward; the output is the same as on the default depth."""
    launches = []

    def record(kernel, grid, *args, **kwargs):
        launches.append((dispatch.kernel_name(kernel), kwargs["num_stages"]))
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    q, k, v = qkv(N=70, d=16)
    call = {"elu": lambda: fused.attention(q, k, v, None, fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False),
            "inline": lambda: fused.attention(q, k, v, None, fused.IDENTITY, 0.0, 0.0, 0.25, True)}[variant]
    default = call()
    settings = dispatch.KernelSettings.read({dispatch.CONFIG_ENV: "64,4,3"})
    for programs in (64, 1):  # heads split over token ranges, then a head per program
        with dispatch.kernels_on(launcher=record, programs=programs, settings=settings):
            out = call()
            out.sum().backward()
        torch.testing.assert_close(out, default, rtol=1e-5, atol=1e-6)
    assert {name for name, _ in launches} == {"state_fwd_kernel", "readout_fwd_kernel", "readout_bwd_kernel",
                                              "state_bwd_kernel", "attention_fwd_kernel", "attention_bwd_kernel"}
    assert {stages for _, stages in launches} == {3}


@pytest.mark.parametrize("version, head_dim, config, chunk", [
    ("3.6.0", 64, None, 32), ("3.8.0", 64, None, 64), ("3.6.0", 32, None, 64), ("3.6.0", 64, "64,4", 64),
    (None, 64, None, 64)])
def test_older_triton_halves_the_chunk_of_the_backwards_it_spills_in(version, head_dim, config, chunk):
    settings = dispatch.KernelSettings.read({dispatch.CONFIG_ENV: config} if config else {})
    with dispatch.kernels_on(settings=settings, older_triton=dispatch.older_than_3_8(version)):
        block_n, block_d, _ = dispatch.block_sizes(head_dim)
        assert dispatch.spill_free_chunk(block_n, block_d) == chunk


@pytest.mark.parametrize("variant, kernel, chunk", [("elu", "attention_bwd_kernel", 32),
                                                    ("mhla", "pairwise_bwd_kernel", 16)])
def test_the_halved_backward_chunks_reach_the_kernels_and_give_the_same_gradients(variant, kernel, chunk,
                                                                                   monkeypatch):
    """Under Triton before 3.8 (dispatch.spill_free_chunk) the one-launch backward and MHLA's pairwise backward run
    on half the token chunk at head dim 64; their gradients are those of the whole chunk."""
    dispatch.current().settings = dispatch.KernelSettings(form="pairwise")
    module = make_module(variant, 64, (4, 4), 1)
    x = torch.randn(1, 17, 128, device=DEVICE)  # (one image: the interpreter runs a program per image and head)
    grad = torch.randn(1, 17, 128, device=DEVICE)

    def gradients(older: bool) -> tuple[list, list]:
        chunks = []

        def record(kernel_fn, grid, *args, **kwargs):
            chunks.append((kernel_fn.fn.__name__, kwargs["BLOCK_N"]))
            return dispatch.build_and_run(kernel_fn, grid, *args, **kwargs)

        with dispatch.kernels_on(launcher=record, older_triton=older):
            inputs = x.clone().requires_grad_()
            found = torch.autograd.grad(module(inputs), [inputs, *module.parameters()], grad)
        return found, [c for name, c in chunks if name == kernel]

    (lean, lean_chunks), (whole, whole_chunks) = gradients(True), gradients(False)
    assert lean_chunks == [chunk] and whole_chunks == [2 * chunk]
    for a, b in zip(lean, whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_mhla_official_denominator_stays_eager(monkeypatch):
    module = make_module("mhla", 32, (4, 4), 1, blocks_per_side=2, denominator="official")
    x = torch.randn(1, 17, 64, device=DEVICE)
    launched = []
    with dispatch.kernels_on(launcher=lambda *a, **k: launched.append(a)):
        torch.testing.assert_close(module(x), helpers.literal(module, x), atol=1e-5, rtol=1e-4)
    assert launched == []




# -- GPUs other than the H200 the launch settings were made for (dispatch.launch): kernels that do not fit on
# their call site's settings run on leaner ones, 16-bit tiles for half inputs, then smaller token chunks, chosen
# once per kernel; the answers stay the N×N forms' within the same bars. Which settings fit which GPU
# generation: benchmarks/kernel_resources.py --arch (tests/attention/test_kernel_resources.py builds them).


@pytest.fixture
def fresh_dispatch():
    with dispatch.kernels_on() as fresh:  # (nothing found about the GPU yet)
        yield fresh


def lean_launches() -> dict[str, dict]:
    """Each kernel the context launched on leaner settings than its call site's: name -> the settings changed."""
    return {dispatch.kernel_name(key[0]): dict(step) for key, step in dispatch.current().settled.items()}


def l40_at_head_dim_128(settings: dict) -> bool:
    """What fits the read-out's and state's backward at head dim 128 on an L40 (99 KB a block): 16-bit tiles and
    16-token chunks (benchmarks/kernel_resources.py --arch sm_89 --head-dims 128)."""
    return settings["TILE"] != tl.float32 and settings["BLOCK_N"] <= 16


def cramp(fits, kernels=BACKWARD_KERNELS) -> dict[str, int]:
    """The context's launches on a GPU where ``kernels`` fit only the settings ``fits`` takes: how many launches of
    each were refused (a live count)."""
    return helpers.cramped(kernels, fits).refused


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


LEAN_CASES = [("elu", True, "split"), ("inline", False, "split"), ("elu", False, "whole"), ("inline", True, "whole")]
# (each backward on both feature maps, masked and not: the lean settings are the chunk and the tile, which the mask
# and the feature are not)


@pytest.mark.parametrize("name,masked,heads", LEAN_CASES,
                         ids=[f"{n}-{'masked' if m else 'all'}-{h}" for n, m, h in LEAN_CASES])
def test_backward_kernels_too_big_for_the_gpu_run_lean_within_the_bf16_bar(name, masked, heads, monkeypatch,
                                                                          fresh_dispatch):
    """bf16 q, k, v; the backward kernels fit only on 16-bit tiles and 16-token chunks: no warning, the kernels
    still run (no eager fallback), and values and gradients keep the N×N form's bf16 bar. ``heads``: split over
    programs (150 tokens: the read-out's and the state's backward), or each in one program (40 tokens: the
    one-launch backward)."""
    kernels = SPLIT_BACKWARD_KERNELS if heads == "split" else ("attention_bwd_kernel",)
    refused = cramp(l40_at_head_dim_128, kernels)
    N = 150 if heads == "split" else 40
    mask = padding_mask(2, N) if masked else None
    q, k, v = qkv(N=N, d=64, dtype=torch.bfloat16)
    with helpers.no_warnings():
        if name == "inline":
            out = fused.attention(q, k, v, mask, fused.IDENTITY, 0.0, 0.0, 64 ** -0.5, True)
            assert_matches_oracle(out, (q, k, v), lambda q, k, v: inline_weights(q, k, mask, 64 ** -0.5) @ v,
                                  TOL[torch.bfloat16])
        else:
            feature, phi = ORACLES[name]
            out = fused.attention(q, k, v, mask, feature, 0.0, 1e-6, 1.0, False)
            assert_matches_oracle(out, (q, k, v), lambda q, k, v: kernel_attention_reference(
                phi(q), phi(k), v, mask, 1e-6), TOL[torch.bfloat16])
    assert dispatch.can_run(q, "linear_attention")  # nothing turned off
    # the first launch of each tried 64- and 32-token chunks on bf16 tiles (bf16 inputs' default for these kernels:
    # launch_plan.tile_name; the one-launch backward starts at 32 under a Triton older than 3.8:
    # dispatch.spill_free_chunk); the rest took what fitted
    tries = {n: 1 if n == "attention_bwd_kernel" and dispatch.older_triton() else 2 for n in kernels}
    assert refused == tries
    assert lean_launches() == {n: {"BLOCK_N": 16} for n in kernels}
    out = fused.attention(q, k, v, mask, fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False) if name != "inline" else (
        fused.attention(q, k, v, mask, fused.IDENTITY, 0.0, 0.0, 64 ** -0.5, True))
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert refused == tries  # remembered


@pytest.mark.parametrize("form", ["blocked", "pairwise"])
def test_an_mhla_module_on_float32_takes_smaller_chunks_and_matches_its_reference(form, monkeypatch, fresh_dispatch):
    """Float32 inputs keep their tiles (the dots' precision is the user's TF32 switch); a GPU where every kernel
    fits only with 16-token chunks runs them all at 16, the whole module within its float32 bars. (The pairwise
    kernels' grid is made of their own BLOCK_M tokens: a smaller chunk of the other side leaves it whole.)"""
    from vitconvert.attention.ops.linear import split_kernels
    from vitconvert.attention.ops.pairwise import kernels as pairwise_kernels

    dispatch.current().settings = dispatch.KernelSettings(form=form)
    where = split_kernels if form == "blocked" else pairwise_kernels
    kernels = [n for n in dir(where) if n.endswith("_kernel")]
    refused = cramp(lambda settings: settings["BLOCK_N"] <= 16, kernels)
    module = make_module("mhla", 32, (6, 7), 1, blocks_per_side=2)
    x = torch.randn(2, 43, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with helpers.no_warnings():
        errors = helpers.float32_against_literal(module, x, padding_mask(2, 43)[:, None, None, :])
    assert errors.pop("output") < 1e-5
    assert not {n: e for n, e in errors.items() if e >= {"block_mix": 1e-3}.get(n, 1e-4)}, errors
    launched = {n for n, count in refused.items() if count}
    assert launched >= ({"state_fwd_kernel", "readout_fwd_kernel", *SPLIT_BACKWARD_KERNELS} if form == "blocked" else
                        {"pairwise_fwd_kernel", "pairwise_bwd_kernel"})
    assert all(step == {"BLOCK_N": 16} for step in lean_launches().values())


def test_a_kernel_that_fits_no_settings_still_falls_back_to_eager_once(monkeypatch, fresh_dispatch):
    """Past the last step (16-bit tiles, 16 tokens) the op's kernels turn off with one warning, as before."""
    refused = cramp(lambda settings: False)
    q, k, v = qkv(N=150, d=64, dtype=torch.bfloat16)
    out = fused.attention(q, k, v, None, fused.ELU_PLUS_ONE, 0.0, 1e-6, 1.0, False)
    with pytest.warns(RuntimeWarning, match="OutOfResources"):
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not dispatch.can_run(q, "linear_attention")
    # bf16 inputs start on 16-bit tiles (launch_plan.tile_name), so the ladder is 64, 32, 16: one kernel
    assert sum(refused.values()) == 3
