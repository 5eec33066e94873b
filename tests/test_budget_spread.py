"""benchmarks/budget_spread.py's TTT probe on a tiny converted model: the fast weights' RMS and the inner step's
share of each layer's attention output, read from the model as it is and leaving it as it was."""

from __future__ import annotations

import torch

from tests.helpers import load_benchmark, tiny_model


def test_the_ttt_probe_reads_the_fast_weights_and_the_steps_share():
    from vitconvert import convert

    spread = load_benchmark("budget_spread")
    student, _ = convert(tiny_model(img_size=16, patch_size=4), to="ttt", seed=0)
    first, second = (b.attn for b in student.blocks)
    with torch.no_grad():
        for w in (first.fast_w1, first.fast_w2, first.fast_w3):
            w.fill_(0.05)
    second.inner_lr = 0.0  # no step: the output is f_W(q) alone
    state = spread.ttt_state(student)
    assert len(state) == 2
    assert abs(state[0]["fast_rms"] - 0.05) < 1e-6
    assert state[0]["step_share"] > 0.01 and state[1]["step_share"] == 0.0
    assert second.inner_lr == 0.0 and first.inner_lr > 1.0  # each layer's step size restored


def test_the_crossed_table_has_each_row_and_column_mean(tmp_path):
    import json

    spread = load_benchmark("budget_spread")
    results = tmp_path / "spread.jsonl"
    top1 = {(0, 0): 0.90, (0, 1): 0.80, (1, 0): 1.00, (1, 1): 0.70}
    curve = [{"epoch": 1, "val_top1": 50.0, "val_loss": 1.0}, {"epoch": 2, "val_top1": 80.0, "val_loss": 0.5}]
    results.write_text("".join(json.dumps({"variant": "elu", "schedule": "b16", "epochs": 2, "regime": "same",
                                           "convert_seed": c, "train_seed": t, "top1": v, "curve": curve}) + "\n"
                               for (c, t), v in top1.items()))
    table = spread.render("elu", ["b16"], 2, "same", results)
    assert "| 0 | 90.00 | 80.00 | 85.00 |" in table and "| 1 | 100.00 | 70.00 | 85.00 |" in table
    assert "| mean | 95.00 | 75.00 | 85.00 ± 12.91 (4) |" in table  # sample std of 90, 80, 100, 70
    assert "val top-1 50.0, 80.0; val loss 1.000, 0.500." in table
