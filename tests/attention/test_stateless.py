"""Attention variants keep no per-call state: what one call computes (InLine's kernels, MHLA's normalised
input) is passed down by ``prepare``, never stored on the module, so calls are re-entrant."""

from __future__ import annotations

import pytest
import torch
from helpers import image_batch, tiny_model

from vitconvert import VARIANTS, convert

OPTIONS = {"inline": {"local_residual": True}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_call_leaves_no_tensor_on_the_module_and_interleaved_calls_agree(variant):
    teacher = tiny_model("vit")
    student, _ = convert(teacher, variant, seed=0, options=OPTIONS.get(variant))
    attn = student.blocks[0].attn.eval()
    tokens = student.patch_embed(image_batch(teacher, batch=2))
    tokens = student._pos_embed(tokens)
    a, b = tokens, tokens.flip(0) + 0.5
    alone_a, alone_b = attn(a), attn(b)
    before = {k for k, v in vars(attn).items() if isinstance(v, torch.Tensor)}
    inner = attn.qkv if getattr(attn, "qkv", None) is not None else attn.q_proj
    handle = inner.register_forward_hook(lambda *_: None if getattr(attn, "_inside", False) else _nested(attn, b))
    try:
        nested_a = attn(a)  # b runs to the end in the middle of a's call (from its projection's hook)
    finally:
        handle.remove()
    assert torch.equal(nested_a, alone_a) and torch.equal(attn(b), alone_b)
    assert {k for k, v in vars(attn).items() if isinstance(v, torch.Tensor)} == before == set()


def _nested(module, x):
    module._inside = True
    try:
        module(x)
    finally:
        module._inside = False
