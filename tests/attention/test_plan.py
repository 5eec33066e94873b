"""The kernel plan (attention/plan.py): values for named GPUs and sizes, the launches it names against those Triton's
interpreter records, settings read from the environment only when a model is built, and `info --kernels`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import MutableMapping

import pytest
import torch

from vitconvert.attention import VARIANTS, plan
from vitconvert.attention.ops import dispatch, launch_plan
from vitconvert.attention.ops.settings import KernelSettings

from . import helpers

DEVICE = helpers.kernels_device()
INTERPRETER = plan.Gpu("Triton's interpreter", (9, 0), 16, 227 * 1024)  # 64 programs wanted, as kernels_on(programs=64)


def layer(variant: str, dim: int = 384, heads: int = 6, grid=(14, 14), **options):
    return VARIANTS[variant](dim, heads, num_prefix_tokens=1, grid_size=grid, **options)


def test_plans_for_named_gpus_and_sizes():
    """deit_small's layer (6 heads of 64) at 224 px: at batch 16 an H100's 528 programs split each head's 197
    tokens in two; at batch 256 one program a head, one launch each way."""
    elu = layer("elu")
    small = plan.plan_layer(elu, plan.GPUS["h100"], torch.bfloat16, 16, settings=KernelSettings())
    assert (small.op, small.splits) == ("linear_attention", 2)
    assert small.forward == ("state_fwd_kernel", "readout_fwd_kernel")
    assert (small.block_n, small.block_d, small.warps, small.stages, small.tile) == (64, 64, 4, 2, "bf16")
    given = plan.plan_layer(elu, plan.GPUS["h100"], torch.bfloat16, 16, settings=KernelSettings(tile_given=True))
    assert given.tile == "tf32"  # VITCONVERT_FUSED_TILE=tf32: the bf16 tiles give way to it, as the launches do
    large = plan.plan_layer(elu, plan.GPUS["h200"], torch.bfloat16, 256, settings=KernelSettings())
    assert (large.splits, large.forward, large.backward) == (1, ("attention_fwd_kernel",), ("attention_bwd_kernel",))
    tuned = plan.plan_layer(elu, plan.GPUS["h100"], torch.bfloat16, 16,
                            settings=KernelSettings(tile="half", config=(32, 8, 3)))
    assert (tuned.block_n, tuned.warps, tuned.stages, tuned.tile) == (32, 8, 3, "bf16")
    assert "163 KB" in plan.plan_layer(elu, plan.GPUS["a100"], torch.bfloat16, 16, settings=KernelSettings()).note
    assert not small.note


@pytest.mark.parametrize("variant, gpu, dtype, reason", [
    ("elu", None, torch.bfloat16, "the CPU"), ("elu", "t4", torch.bfloat16, "sm_75"),
    ("elu", "h100", torch.float64, "float64 inputs"), ("ttt", "h100", torch.float32, "float32 inputs"),
    ("mhla", "h100", torch.bfloat16, "official denominator")])
def test_the_plan_says_why_a_layer_runs_eager(variant, gpu, dtype, reason):
    options = {"denominator": "official"} if variant == "mhla" else {}
    found = plan.plan_layer(layer(variant, **options), plan.GPUS.get(gpu), dtype, 16, settings=KernelSettings())
    assert not found.on_kernels and reason in found.reason, found
    off = plan.plan_layer(layer(variant), plan.GPUS["h100"], torch.bfloat16, 16, settings=KernelSettings(fused=False))
    assert "VITCONVERT_FUSED=0" in off.reason
    wide = plan.plan_layer(layer("ttt", dim=192, heads=2), plan.GPUS["h100"], torch.bfloat16, 16,
                           settings=KernelSettings())
    assert "head dim 96" in wide.reason  # (TTT's kernels take head dims up to 64)


def test_mhla_takes_the_form_that_moves_less():
    mhla = layer("mhla")
    pairwise = plan.plan_layer(mhla, plan.GPUS["h100"], torch.bfloat16, 16, settings=KernelSettings())
    assert pairwise.op == "pairwise_attention" and not pairwise.others  # (LePE in its kernels' epilogues)
    blocked = plan.plan_layer(layer("mhla", grid=(24, 24)), plan.GPUS["h100"], torch.bfloat16, 16,
                              settings=KernelSettings())
    assert blocked.op == "blocked_attention"  # (each token's 1/rms over heads of q and k, then W̃, LePE in its kernels)
    assert blocked.forward == ("state_fwd_kernel", "readout_fwd_kernel")
    assert len(blocked.backward) == 3 and not blocked.others  # (W̃ and LePE in its kernels: no grid op)
    forced = plan.plan_layer(mhla, plan.GPUS["h100"], torch.bfloat16, 16, settings=KernelSettings(form="blocked"))
    assert forced.op == "blocked_attention"


def test_head_dim_128_reads_out_backward_in_16_token_chunks():
    """ViT-H-style heads of 128: the read-out's backward holds dR and Rᵀ at 128×128 and spilled registers in 32-token
    chunks (116 on sm_89); the plan names its 16-token chunk, and head dim 64 keeps the layer's."""
    wide = plan.plan_layer(layer("elu", dim=1280, heads=10), plan.GPUS["l40"], torch.bfloat16, 16,
                           settings=KernelSettings())
    assert (wide.block_n, wide.backward) == (32, ("state_fwd_kernel", "readout_bwd_kernel (BLOCK_N 16)",
                                                  "state_bwd_kernel"))
    assert "readout_bwd_kernel" in plan.plan_layer(layer("elu"), plan.GPUS["h100"], torch.bfloat16, 16,
                                                   settings=KernelSettings()).backward


def test_mhla_reads_out_backward_in_16_token_chunks_before_sm_90():
    """MHLA's blocked read-out backward (TF32 tiles of bf16 inputs, the norm as q loads) spilled 22 registers on sm_80
    and 6 on sm_86/sm_89 in 32-token chunks at head dim 64, none on sm_90: the plan names 16 before sm_90 only, and
    the launches take what the plan names for the generation the dispatch says."""
    mhla = layer("mhla", grid=(24, 24))
    chunks = {name: plan.plan_layer(mhla, plan.GPUS[name], torch.bfloat16, 16, settings=KernelSettings())
              for name in ("a100", "a10", "l40", "h100")}
    assert {name: found.launches.readout_bwd_block_n for name, found in chunks.items()} == {
        "a100": 16, "a10": 16, "l40": 16, "h100": 32}
    assert chunks["a100"].op == "blocked_attention" and "readout_bwd_kernel (BLOCK_N 16)" in chunks["a100"].backward
    q = torch.zeros(1, 6, 577, 64, dtype=torch.bfloat16)
    for capability, chunk in (((8, 6), 16), ((9, 0), 32), (None, 32)):  # (None: the CPU's interpreter, sm_90's)
        with dispatch.kernels_on(capability=capability):
            assert launch_plan.linear_launches(q, 6, 26, 64, False).readout_bwd_block_n == chunk


def launched(module, x, programs: int, settings: KernelSettings) -> tuple[list, list]:
    """The (kernel, BLOCK_N, num_warps, num_stages, programs over tokens, operand tile) of a forward's launches, then
    of its backward's."""
    record: list = []

    def launch(kernel, grid, *args, **kwargs):
        record.append((dispatch.kernel_name(kernel), kwargs["BLOCK_N"], kwargs["num_warps"],
                       kwargs.get("num_stages"), grid[-1] if len(grid) > 1 else None, kwargs.get("TILE")))
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    with dispatch.kernels_on(DEVICE, launcher=launch, programs=programs, settings=settings):
        out = module(x)
        forward = list(record)
        out.float().sum().backward()
    return forward, record[len(forward):]


@pytest.mark.parametrize("variant, programs, form", [
    ("elu", 64, "auto"), ("elu", 4, "auto"), ("inline", 64, "auto"), ("mhla", 64, "auto"), ("mhla", 64, "blocked"),
    ("ttt", 64, "auto")])
def test_the_plan_names_the_kernels_that_launch(variant, programs, form):
    """The plan against the launches of one training step in the interpreter (bf16 inputs, as under autocast):
    the same kernels each way, on the plan's BLOCK_N, warps and stages; where it names the state and read-out
    launches, each takes exactly the plan's chunk, token ranges and operand tile; the grid op's launches (its
    ``others``) its BLOCK_M and warps."""
    module = helpers.make_module(variant, 1, (4, 4), dim=64, dtype=torch.bfloat16).to(DEVICE)
    x = torch.randn(2, 17, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    gpu = plan.Gpu("interpreter", (9, 0), programs // dispatch.PROGRAMS_PER_SM, 227 * 1024)
    settings = KernelSettings(form=form)
    expected = plan.layer_plan(module, gpu, torch.bfloat16, 2, settings=settings)
    forward, backward = launched(module, x, programs, settings)

    def names(launches):
        # (the grid op's kernels, TTT's key statistics among them, are the plan's ``others``)
        return [name for name, *_ in dict.fromkeys(launches) if not name.startswith(("grid_conv", "key_moments"))]

    assert expected.on_kernels, expected
    assert list(dict.fromkeys(names(forward))) == list(expected.forward)
    assert set(names(backward)) == {k.split(" ")[0] for k in expected.backward}
    assert_the_grid_op_takes_the_plan(forward + backward, expected)
    first = next(launch for launch in forward if launch[0] == expected.forward[0])
    assert first[1:3] == (expected.block_n, expected.warps)
    assert first[3] == (expected.stages or None)  # (0: the launch passes none, Triton's default)
    if variant == "ttt":  # (the step's kernels: the plan's chunk, warps and token ranges each way)
        steps = {(*launch[1:3], launch[4] or 1) for launch in forward + backward  # (one program a head: a 1-D grid)
                 if launch[0].split("_")[0] in TTT_STEP}
        assert steps == {(expected.block_n, expected.warps, expected.splits)}
    elif expected.op == "pairwise_attention":  # (each launch on the plan's chunk, warps and tile, as its names say)
        assert {(name, *launch[:2], launch[-1]) for name, *launch in forward + backward} == pairwise_taken(expected)
    elif expected.launches is not None:
        ran = {launch[0] for launch in forward + backward} & TAKES.keys()
        assert {launch[1:] for launch in forward + backward if launch[0] in ran} == \
            {taken(name, expected.launches) for name in ran}


def pairwise_taken(expected: plan.KernelPlan) -> set:
    """(kernel, BLOCK_N, warps, operand tile) of MHLA's pairwise launches by the plan, as its backward's name says."""
    found = expected.pairwise
    assert f"BLOCK_N {found.backward_block_n}, {found.backward_warps} warps" in expected.backward[0]
    tile = {name: launch_plan.tile_kwargs(name)["TILE"] for name in (found.tile, found.backward_tile)}
    return {("pairwise_fwd_kernel", found.block_m, found.warps, tile[found.tile]),
            ("pairwise_bwd_kernel", found.backward_block_n, found.backward_warps, tile[found.backward_tile])}


def assert_the_grid_op_takes_the_plan(launches: list, expected: plan.KernelPlan) -> None:
    """The grid op's launches (the key statistics' among them) are the plan's ``others``, on its grid's BLOCK_M and
    warps."""
    on_grid = [launch for launch in launches if launch[0].startswith(("grid_conv", "key_moments"))]
    assert {name for name, *_ in on_grid} == {other.split(" ")[0] for other in expected.others}
    assert {launch[1:3] for launch in on_grid} == ({(expected.grid.block_m, expected.grid.warps)} if on_grid else set())


def taken(kernel: str, launches: launch_plan.LinearLaunches) -> tuple:
    """What a launch of ``kernel`` takes by the plan: (BLOCK_N, warps, stages, programs over tokens, tile)."""
    block_n, splits = TAKES[kernel](launches)
    return (block_n, launches.warps, launches.stages, splits, launch_plan.tile_kwargs(launches.tile)["TILE"])


TTT_STEP = ("inner", "swiglu", "ttt")  # (TTT's step kernels: inner_sums*, swiglu_readout*, ttt_fwd/bwd)
TAKES = {  # kernel -> (its BLOCK_N, its programs over tokens) by the plan
    "state_fwd_kernel": lambda p: (p.block_n, p.splits), "readout_fwd_kernel": lambda p: (p.block_n, p.read_splits),
    "readout_bwd_kernel": lambda p: (p.readout_bwd_block_n, p.splits),
    "state_bwd_kernel": lambda p: (p.block_n, p.read_splits),
    "attention_fwd_kernel": lambda p: (p.block_n, None),
    "attention_bwd_kernel": lambda p: (p.one_launch_bwd_block_n, None)}


def test_a_layer_keeps_its_plan_per_gpu_dtype_and_size():
    """Decided once: the same value at the second ask, kept on the layer; another size or dtype is another plan."""
    elu = layer("elu")
    first = plan.layer_plan(elu, plan.GPUS["h100"], torch.bfloat16, 16, settings=KernelSettings())
    assert plan.layer_plan(elu, plan.GPUS["h100"], torch.bfloat16, 16, settings=KernelSettings()) is first
    larger = plan.layer_plan(elu, plan.GPUS["h100"], torch.bfloat16, 256, settings=KernelSettings())
    assert larger.splits == 1 and first.splits == 2 and len(elu.kernel_plans) == 2
    assert first.launches.tile == "bf16" and (first.launches.per, first.launches.read_splits) == (128, 2)
    assert plan.layer_plan(elu, None, torch.float32, 16) is not first and len(elu.kernel_plans) == 3


class CountedEnvironment(MutableMapping):
    """os.environ, counting the reads vitconvert's own code makes of it."""

    def __init__(self, environ) -> None:
        self.environ, self.reads = environ, 0

    def __getitem__(self, key):
        frame = sys._getframe(1)
        skipped = (__name__, "collections.abc", "os")  # (this class, Mapping.get, os.getenv)
        while frame is not None and frame.f_globals.get("__name__") in skipped:
            frame = frame.f_back
        if frame is not None and str(frame.f_globals.get("__name__")).startswith("vitconvert"):
            self.reads += 1
        return self.environ[key]

    def __setitem__(self, key, value):
        self.environ[key] = value

    def __delitem__(self, key):
        del self.environ[key]

    def __iter__(self):
        return iter(self.environ)

    def __len__(self):
        return len(self.environ)


@pytest.mark.parametrize("variant", ["elu", "mhla", "ttt"])
def test_a_training_step_reads_no_environment_after_the_model_is_built(variant, monkeypatch, kernels_on_the_cpu):
    """The settings are read when a model is built (6, 12 and 33 reads a layer's training step for ELU, MHLA and
    TTT before: every launch read them)."""
    counted = CountedEnvironment(os.environ)
    monkeypatch.setattr(os, "environ", counted)
    module = helpers.make_module(variant, 1, (4, 4), dim=64, dtype=torch.bfloat16).to(DEVICE)
    assert counted.reads >= 4  # (the four settings, checked where a bad one is a one-line error)
    x = torch.randn(1, 17, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)  # (one image: interpreter)
    module(x).float().sum().backward()  # (the first call: what is read once, on first use)
    counted.reads = 0
    module(x).float().sum().backward()
    assert counted.reads == 0


def test_info_kernels_prints_each_layers_plan(tmp_path):
    """Through the console script, in a pipe: plain text, one row a layer, and a wrong --gpu one line; --json the
    plans as values (typer's runner: the same command in this process)."""
    from helpers import invoke, tiny_model

    import vitconvert

    student, _ = vitconvert.convert(tiny_model("vit"), "elu")
    vitconvert.save(student, tmp_path / "m")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "vitconvert", "info", str(tmp_path / "m"), "--kernels", "--gpu", "h200"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "NVIDIA H200" in done.stdout and "blocks.0.attn" in done.stdout and "linear_attention" in done.stdout
    assert "\x1b[" not in done.stdout  # (a pipe: no colour codes)
    as_json = invoke(*command[3:], "--dtype", "float32", "--json")
    assert as_json.exit_code == 0, as_json.output
    layers = json.loads(as_json.stdout)["layers"]
    assert layers and all(row["op"] == "linear_attention" and row["tile"] in ("tf32", "fp32") for row in layers)
    bad = subprocess.run([*command[:-1], "h300"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "--gpu" in bad.stderr and "Traceback" not in bad.stderr


def test_info_names_the_plans_gpus_without_importing_torch():
    """`info --gpu`'s help and its early refusal read a copy of the GPU table's names (no torch import for either):
    the copy must be the table's."""
    from vitconvert.attention import plan
    from vitconvert.cli import info

    assert info.GPU_NAMES.split(", ") == list(plan.GPUS)


def test_ttt_ranges_keep_their_partial_sums_within_their_tokens_while_the_gpu_stays_filled():
    """deit_small's layer at 1024 px (4097 tokens), one image, on an H100 (528 programs wanted): ELU cuts each head
    into 33 ranges of 128 tokens. TTT's three d×d float32 partial sums a range (48 KB) would outweigh such a range's
    bf16 keys and values (32 KB), so its ranges take 256 tokens: 17 a head, 102 programs, still about a program an
    SM (132), where 198 ran in two waves of its one block an SM. At batch 16 (96 heads) or 224 px, where the ranges
    are long enough or no second wave is saved, TTT's are ELU's. The op's launches take the plan's ranges."""
    from vitconvert.attention.ops.ttt.op import PARTIAL_SQUARES

    plans = {(variant, batch, side): plan.plan_layer(layer(variant, grid=(side, side)), plan.GPUS["h100"],
                                                     torch.bfloat16, batch, settings=KernelSettings())
             for variant in ("elu", "ttt") for batch in (1, 16) for side in (14, 64)}
    assert plans["ttt", 1, 64].on_kernels
    assert (plans["elu", 1, 64].splits, plans["ttt", 1, 64].splits) == (33, 17)
    partial_bytes, token_bytes = PARTIAL_SQUARES * 64 * 64 * 4, 2 * 64 * 2  # (a range's sums; a token's k and v)
    assert 128 * token_bytes < partial_bytes <= launch_plan.PARTIAL_SHARE * 256 * token_bytes
    for batch, side in ((16, 64), (1, 14), (16, 14)):
        assert plans["ttt", batch, side].splits == plans["elu", batch, side].splits, (batch, side)
    q = torch.zeros(1, 6, 4097, 64, dtype=torch.bfloat16)
    with dispatch.kernels_on(programs=528):
        taken = launch_plan.linear_launches(q, 6, 1, 4097, False, True, PARTIAL_SQUARES)
    assert (taken.splits, taken.per) == (17, 256)


def test_ttt_keeps_w_prime_for_backward_where_softmax_keeps_as_much_more():
    """deit_small's layer on an H100 at batch 1, heads split at every size: at 1280 px (6401 tokens) W' (three 64×64
    matrices a head, in bf16 as the backward's tiles read them: 24 KB) fits in what softmax's attention keeps beyond
    TTT's (SDPA's float32 logsumexp, 25.0 KB a head, less TTT's key statistics, 0.5 KB), so the forward keeps it and
    the backward skips the sums kernel that formed it again; at 1024 px (4097 tokens: 15.5 KB of room) and 224 px
    it does not fit, and backward forms it again. A q (512 KB a head at 1024 px) is never what binds."""
    plans = {side: plan.plan_layer(layer("ttt", grid=(side, side)), plan.GPUS["h100"], torch.bfloat16, 1,
                                   settings=KernelSettings()) for side in (14, 64, 80)}
    assert all(p.on_kernels and p.splits > 1 for p in plans.values())
    assert plans[80].kept == ("W'",) and "inner_sums_kernel" not in plans[80].backward
    for side in (14, 64):
        assert plans[side].kept == () and plans[side].backward[0] == "inner_sums_kernel", side
    w_prime = 3 * 64 * 64 * launch_plan.kept_dtype(torch.bfloat16).itemsize
    room = {side: (side * side + 1) * launch_plan.SOFTMAX_EXTRA_BYTES - 2 * 64 * 4 for side in (64, 80)}
    assert room[64] < w_prime <= room[80] < launch_plan.KEPT_SHARE * (80 * 80 + 1) * 64 * 2
    assert [launch_plan.keeps_summed(3, 64, torch.bfloat16, chunks, 128) for chunks in (49, 50)] == [False, True]
    assert launch_plan.kept_dtype(torch.float32) == torch.float32  # (float32 tiles: W' kept from about 12.4k tokens)
