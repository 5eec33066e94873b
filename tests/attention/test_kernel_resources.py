"""benchmarks/kernel_resources.py without a GPU: each op's kernels listed (Triton's interpreter builds nothing,
so no registers); every kernel built for an H200 by Triton's compiler (--arch sm_90), fitting and not spilling;
its errors in one line. The whole listing: ``python benchmarks/kernel_resources.py [--arch sm_90]``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_benchmark

from vitconvert.attention.ops import dispatch, launch_plan

pytest.importorskip("triton")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if not torch.cuda.is_available() and not dispatch.interpreting():
    pytest.skip("no GPU, and Triton's interpreter was not chosen before triton was imported (tests/conftest.py)",
                allow_module_level=True)


def test_every_op_lists_the_kernels_it_launches(capsys):
    script = load_benchmark("kernel_resources")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    devices = dispatch.current().devices
    rows = script.measure([16], device, side=4, ops=("linear_attention elu", "ttt_step"))  # (the interpreter's time)
    assert dispatch.current().devices == devices
    kernels = {(row["op"], row["kernel"]) for row in rows}
    assert kernels == {("linear_attention elu", k) for k in ("attention_fwd_kernel", "attention_bwd_kernel")} | {
        ("ttt_step", k) for k in ("ttt_fwd_kernel", "ttt_bwd_kernel")}  # (the convs' backward in ttt_bwd_kernel)
    assert all(row["head_dim"] == 16 and row["BLOCK_D"] == 16 and row["num_warps"] > 0 for row in rows)
    if device.type == "cpu":
        assert all(row["registers"] is None for row in rows)
        script.print_table(rows, device)
        out = capsys.readouterr().out
        assert "no GPU" in out and "ttt_bwd_kernel" in out


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    script = load_benchmark("kernel_resources")
    assert script.main(["--head-dims", "8,64"]) == 2
    assert script.main(["--ops", "linear_attention relu"]) == 2
    assert script.main(["--head-dims", "x"]) == 2
    assert script.main(["--json", str(tmp_path / "nowhere" / "r.json")]) == 2
    assert script.main(["--arch", "sm_99"]) == 2
    assert script.main(["--max-registers", "128"]) == 2  # (a cap on a build: --arch only)
    err = capsys.readouterr().err
    assert "error: --max-registers: 24..255, with --arch; got 128" in err
    assert "error: --ops: comma-separated, of: linear_attention elu" in err
    assert "error: --head-dims" in err and "error: --json" in err and "error: --arch: one of sm_70, sm_75, sm_80" in err
    assert "Traceback" not in err
    if dispatch.interpreting():  # (this process's kernels are the interpreter's: --arch needs the compiler's)
        assert script.main(["--arch", "sm_90"]) == 2
        assert "unset TRITON_INTERPRET" in capsys.readouterr().err


def nvidia_build_tools() -> bool:
    try:
        import triton  # lazy: start-up time

        return all(Path(t.path).exists() for t in (triton.knobs.nvidia.ptxas, triton.knobs.nvidia.cuobjdump))
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return False


def cross_build(tmp_path: Path, *args: str, arch: str = "sm_90") -> tuple[list[dict], str]:
    """kernel_resources.py --arch ARCH ARGS in a process without TRITON_INTERPRET: (rows, stdout)."""
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "kernel_resources.py"), "--arch", arch, *args,
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return json.loads(out.read_text())["rows"], done.stdout


@pytest.mark.skipif(not nvidia_build_tools(), reason="this Triton ships no ptxas/cuobjdump")
def test_every_kernel_builds_for_an_h200_fits_and_does_not_spill(tmp_path):
    """Triton's compiler, not its interpreter, builds every kernel the ops launch at head dim 64 (DeiT's) for sm_90
    (H100, H200): none is refused (the interpreter ran a TTT backward kernel the compiler rejects: a loop
    variable whose shape changed), none needs more shared memory than a block may have (TTT's sums' backward on
    TF32 tiles needed 248 KB of 227), none spills registers."""
    rows, stdout = cross_build(tmp_path, "--head-dims", "64")
    assert f"Triton {dispatch.triton_version()}: fused kernels as built for sm_90" in stdout  # (3.6 spills more)
    built = {(row["op"], row["kernel"]) for row in rows}
    assert {op for op, _ in built} == {"linear_attention elu", "linear_attention inline", "blocked_attention mhla",
                                       "pairwise_attention mhla", "ttt_step", "linear_attention elu split",
                                       "ttt_step split"}
    assert {k for op, k in built if op == "pairwise_attention mhla"} == {
        "pairwise_fwd_kernel", "pairwise_bwd_kernel"}
    assert {k for op, k in built if op == "ttt_step"} == {"ttt_fwd_kernel", "ttt_bwd_kernel"}  # (the convs' backward
    # in ttt_bwd_kernel)
    assert {k for op, k in built if op == "ttt_step split"} == {"key_moments_kernel", "inner_sums_kernel",
                                                                "swiglu_readout_kernel", "swiglu_readout_bwd_kernel",
                                                                "inner_sums_bwd_kernel", "grid_conv_bwd_kernel"}
    assert all(row["registers"] > 0 for row in rows)
    assert [row for row in rows if not row["fits"] or row["spills"] or row["blocks_per_sm"] < 1] == []
    assert f"0 of {len(rows)} builds need more shared memory" in stdout


@pytest.mark.slow  # (two minutes of builds)
@pytest.mark.skipif(not nvidia_build_tools(), reason="this Triton ships no ptxas/cuobjdump")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_head_dim_and_dtype_builds_for_an_h200_and_fits(tmp_path, dtype):
    """Head dims 16–128 (48 and 80 not powers of two), each input dtype: every kernel dispatch may launch builds
    and fits (some spill: docs/performance.md)."""
    rows, _ = cross_build(tmp_path, "--head-dims", "16,48,80,128", "--dtype", dtype)
    assert {row["head_dim"] for row in rows} == {16, 48, 80, 128}
    assert [row for row in rows if not row["fits"]] == []


def test_occupancy_is_the_least_of_registers_shared_memory_and_warps():
    script = load_benchmark("kernel_resources")
    assert script.blocks_per_sm("sm_90", 136, 65536, 4) == 3  # 17 steps of 256 a warp: 3 blocks; shared: 3
    assert script.blocks_per_sm("sm_90", 255, 0, 8) == 1  # registers
    assert script.blocks_per_sm("sm_90", 32, 0, 4) == 16  # warp slots (64 / 4)
    assert script.blocks_per_sm("sm_86", 32, 49152, 4) == 2  # shared memory (100 KB an SM)
    assert script.blocks_per_sm("sm_89", 32, 101377, 4) == 0  # over a block's limit: does not run
    assert script.blocks_per_sm("sm_75", 32, 32768, 4) == 2  # (no 1 KB reserved per block before sm_80)


def ran(rows: list[dict]) -> dict[tuple, dict]:
    """(head dim, op, kernel) -> the settings each kernel ran on (the last build that fitted)."""
    return {(row["head_dim"], row["op"], row["kernel"]): row for row in rows if row["fits"]}


LINEAR_KERNELS = {"linear_attention elu": {"attention_fwd_kernel", "state_fwd_kernel", "readout_bwd_kernel",
                                           "state_bwd_kernel"},
                  "blocked_attention mhla": {"state_fwd_kernel", "readout_fwd_kernel",
                                             "readout_bwd_kernel", "state_bwd_kernel"}}


@pytest.mark.skipif(not nvidia_build_tools(), reason="this Triton ships no ptxas/cuobjdump")
def test_on_an_l40_the_head_dim_128_backward_kernels_run_on_leaner_settings(tmp_path):
    """An L40 or RTX 4090 (sm_89) gives a block 99 KB of shared memory; at head dim 128 the state's backward needs
    more on the tiles its call site asks for (ELU: bf16 tiles for bf16 inputs; MHLA: TF32). Refused as Triton's
    launcher refuses it there, dispatch runs it on 16-bit tiles (32 tokens fit with two stages); the read-out
    backward takes 16-token chunks at head dim 128 from the start (launches.readout_gradients). Every kernel of ELU
    and MHLA runs (none falls back to the eager form)."""
    rows, stdout = cross_build(tmp_path, "--head-dims", "128", "--ops", "linear_attention elu,blocked_attention mhla",
                               arch="sm_89")
    runs = ran(rows)
    assert {(op, kernel) for _, op, kernel in runs} == {(op, k) for op, ks in LINEAR_KERNELS.items() for k in ks}
    for op in LINEAR_KERNELS:
        first = runs[128, op, "attention_fwd_kernel" if "elu" in op else "readout_fwd_kernel"]
        assert first["tile"] == ("bf16" if "elu" in op else "tf32")
        assert (runs[128, op, "readout_bwd_kernel"]["tile"], runs[128, op, "readout_bwd_kernel"]["BLOCK_N"]) == (
            ("bf16", 16) if "elu" in op else ("tf32", 16))
        assert (runs[128, op, "state_bwd_kernel"]["tile"], runs[128, op, "state_bwd_kernel"]["BLOCK_N"]) == (
            "bf16", 32)  # 16-bit tiles fit 99 KB at 32 tokens with two stages
    assert all(row["shared_bytes"] <= 101376 for row in runs.values())
    assert "runs lean: state_bwd_kernel (d 128, blocked_attention mhla) on bf16 tiles, BLOCK_N 32" in stdout
    assert "fits no settings" not in stdout


@pytest.mark.slow  # (two minutes of builds)
@pytest.mark.skipif(not nvidia_build_tools(), reason="this Triton ships no ptxas/cuobjdump")
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_100", "sm_120"])
def test_every_linear_kernel_runs_on_an_a100_an_l40_a_b200_and_an_rtx_5090(tmp_path, arch):
    """Head dims 64 and 128: every kernel of the linear ops runs on each generation (some on leaner settings; ELU at
    64 in one launch each way, at 128 in its three-launch backward);
    TTT's sums' backward (twelve d×d operands, 106 KB at the least) fits no settings in the 99 KB of sm_86/sm_89,
    (and sm_120's), where two kernels take its place (ten and six operands) and TTT keeps its kernels."""
    rows, stdout = cross_build(tmp_path, "--head-dims", "64,128", arch=arch)
    runs = ran(rows)
    for d in (64, 128):
        for op, kernels in LINEAR_KERNELS.items():
            if op == "linear_attention elu" and d <= launch_plan.ONE_LAUNCH_BACKWARD_MAX_HEAD_DIM:
                kernels = {"attention_fwd_kernel", "attention_bwd_kernel"}  # (a head in one program, each way)
            assert {k for dd, o, k in runs if (dd, o) == (d, op)} == kernels, (arch, d, op)
    ttt = {kernel for d, op, kernel in runs if op == "ttt_step"}
    if arch in ("sm_86", "sm_89", "sm_120"):  # (the whole backward in one kernel holds as many operands)
        assert ttt == {"ttt_fwd_kernel", "ttt_readout_bwd_kernel", "inner_sums_bwd_keys_kernel",
                       "inner_sums_bwd_values_kernel", "grid_conv_bwd_kernel"}
        assert "fits no settings: inner_sums_bwd_kernel (d 64, ttt_step); that op launches other kernels" in stdout
        assert "fits no settings: ttt_bwd_kernel (d 64, ttt_step); that op launches other kernels" in stdout
        assert "runs its eager form" not in stdout
    else:
        assert ttt == {"ttt_fwd_kernel", "ttt_bwd_kernel"} and "fits no settings" not in stdout
    for d in (64, 128):  # (its partial chunk under an `if` spilled the dS tiles before Hopper)
        assert runs[d, "linear_attention elu split", "state_bwd_kernel"]["spills"] == 0, (arch, d)
    if arch == "sm_80":  # (ptxas -O3 once gave it 32 registers and 2,208 spilled: docs/performance.md)
        sums = runs[64, "ttt_step split", "inner_sums_bwd_kernel"]
        assert sums["registers"] > 128 and sums["spills"] < 500


@pytest.mark.slow  # (20 s of builds)
@pytest.mark.skipif(not nvidia_build_tools(), reason="this Triton ships no ptxas/cuobjdump")
def test_why_a_t4_runs_the_eager_form(tmp_path):
    """Built for a T4 (sm_75: no bf16 or TF32 tensor cores), the kernels spill hundreds of registers even on fp16
    inputs, which is why dispatch keeps GPUs before sm_80 on the eager form (dispatch.MIN_CAPABILITY)."""
    rows, stdout = cross_build(tmp_path, "--head-dims", "64", "--ops", "linear_attention elu", "--dtype", "float16",
                               arch="sm_75")
    assert max(row["spills"] for row in rows) > 400
    assert "dispatch runs the eager form on sm_75" in stdout
