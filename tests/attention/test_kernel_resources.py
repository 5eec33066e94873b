"""benchmarks/kernel_resources.py without a GPU: each op's kernels listed (Triton's interpreter builds nothing,
so no registers), and its errors in one line. The whole listing: ``python benchmarks/kernel_resources.py``."""

from __future__ import annotations

import pytest
import torch
from helpers import load_benchmark

from vitconvert.attention import dispatch

pytest.importorskip("triton")
if not torch.cuda.is_available() and not dispatch.interpreting():
    pytest.skip("no GPU, and Triton's interpreter was not chosen before triton was imported (tests/conftest.py)",
                allow_module_level=True)


def test_every_op_lists_the_kernels_it_launches(capsys):
    script = load_benchmark("kernel_resources")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    devices = dispatch.DEVICES
    rows = script.measure([16], device, side=4, ops=("linear_attention elu", "ttt_step"))  # (the interpreter's time)
    assert dispatch.DEVICES == devices
    kernels = {(row["op"], row["kernel"]) for row in rows}
    assert kernels == {("linear_attention elu", k) for k in ("attention_fwd_kernel", "state_fwd_kernel",
                                                             "readout_bwd_kernel", "state_bwd_kernel")} | {
        ("ttt_step", k) for k in ("inner_sums_kernel", "swiglu_readout_kernel", "swiglu_readout_bwd_kernel",
                                  "inner_sums_bwd_kernel")}
    assert all(row["head_dim"] == 16 and row["BLOCK_D"] == 16 and row["num_warps"] > 0 for row in rows)
    if device.type == "cpu":
        assert all(row["registers"] is None for row in rows)
        script.print_table(rows, device)
        out = capsys.readouterr().out
        assert "no GPU" in out and "inner_sums_bwd_kernel" in out


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    script = load_benchmark("kernel_resources")
    assert script.main(["--head-dims", "8,64"]) == 2
    assert script.main(["--head-dims", "x"]) == 2
    assert script.main(["--json", str(tmp_path / "nowhere" / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "error: --head-dims" in err and "error: --json" in err and "Traceback" not in err
