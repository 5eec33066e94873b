"""benchmarks/budget_hedgehog.py's probe, without training: the attention weights it reads from a layer are the
ones that layer computes (weights × V is the layer's own mixing, for the softmax teacher and for a Hedgehog
student), and a map started at S·I is measured from that start."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

SCRIPTS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(SCRIPTS))
import budget_hedgehog  # noqa: E402  (a script beside the package, not a module of it)


@pytest.fixture(scope="module")
def pair():
    from vitconvert.capture import attention_pairs
    from vitconvert.sources import load_source

    teacher = load_source("digits").model.eval()
    student = budget_hedgehog.student("hedgehog", 2.0).eval()
    with torch.no_grad():  # a trained-looking map: not the identity, so q's and k's maps differ
        for m in budget_hedgehog._maps(student):
            m.weight.add_(0.1 * torch.randn(m.weight.shape, generator=torch.Generator().manual_seed(0)))
    return attention_pairs(student, teacher)


def test_the_weights_times_v_are_each_layers_own_mixing(pair):
    mine, theirs = pair
    x = torch.randn(2, 17, mine[0].attn_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        s, t = mine[0], theirs[0]
        q, k, v = s.project(x)
        torch.testing.assert_close(budget_hedgehog._weights(s, x) @ v, s.mix(q, k, v, None, s.resolve_grid(17)),
                                   atol=1e-5, rtol=1e-4)
        B, N, _ = x.shape
        tq, tk, tv = t.qkv(x).reshape(B, N, 3, t.num_heads, -1).permute(2, 0, 3, 1, 4)
        torch.testing.assert_close(budget_hedgehog._weights(t, x) @ tv, F.scaled_dot_product_attention(tq, tk, tv),
                                   atol=1e-5, rtol=1e-4)


def test_a_map_started_at_s_times_identity_is_measured_from_there():
    model = budget_hedgehog.student("hedgehog", 2.0)
    assert budget_hedgehog.map_shift(model, 2.0) == pytest.approx(0.0, abs=1e-7)
    assert budget_hedgehog.map_shift(model, 1.0) == pytest.approx(1.0)  # 2I − I is ‖I‖ away from I
