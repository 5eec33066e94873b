"""Feature maps of bf16 tiles in inline PTX, two entries a thread instruction (``bf16x2``): what the kernels' φ
costs on bf16 operand tiles (:func:`.kernel_parts._phi_tile` takes them; benchmarks/kernel_instructions.py counts
them). They run only on a GPU: Triton's interpreter runs no PTX, and the kernels take float32's φ rounded to bf16
there, which these give bit for bit (tests/attention/test_bf16_pairs.py checks the identity over every bf16 value;
benchmarks/gpu_check_parity.py and probe_kernels.py check the PTX first on a GPU). NaN stays NaN, as in torch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _elu_plus_one_pairs(x):
    """elu(x) + 1 of a bf16 tile, in bf16, two entries a thread instruction: max(x + 1, exp(min(x, 0))) is φ
    (eˣ ≥ x + 1), each side rounded once as float32's φ rounded to bf16 is (the same bits), eˣ from float32
    exp2 of x·log2(e) as Triton's exp makes it; NaN stays NaN."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 m, lo, hi;
        min.NaN.bf16x2 m, $1, $2;
        shl.b32 lo, m, 16;
        and.b32 hi, m, 0xFFFF0000;
        mul.f32 lo, lo, 0f3FB8AA3B;
        mul.f32 hi, hi, 0f3FB8AA3B;
        ex2.approx.ftz.f32 lo, lo;
        ex2.approx.ftz.f32 hi, hi;
        cvt.rn.bf16x2.f32 m, hi, lo;
        fma.rn.bf16x2 lo, $1, $3, $3;
        max.NaN.bf16x2 $0, lo, m;
        }""", "=r,r,r,r", [x, tl.full(x.shape, 0.0, tl.bfloat16), tl.full(x.shape, 1.0, tl.bfloat16)],
        dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _relu_pairs(x):
    """relu(x) of a bf16 tile, in bf16, two entries a thread instruction (exact: no rounding); NaN stays NaN (the
    float32 form's maximum gives 0 there)."""
    return tl.inline_asm_elementwise("max.NaN.bf16x2 $0, $1, $2;", "=r,r,r", [x, tl.full(x.shape, 0.0, tl.bfloat16)],
                                     dtype=tl.bfloat16, is_pure=True, pack=2)
