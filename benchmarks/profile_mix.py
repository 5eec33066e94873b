"""Where one attention layer's time goes on a GPU: torch.profiler over each variant's token mixing.

    python benchmarks/profile_mix.py                 # N = 4097 (1024 px), forward + backward, bf16 autocast
    python benchmarks/profile_mix.py --tokens 197 --infer
    python benchmarks/profile_mix.py --sweep elu         # the kernels' launch configurations, timed

For SDPA and each variant (q, k, v of shape (B, H, N, d) as autocast hands them over, the module's ``mix`` with
its default dispatch): the wall time per call, then torch.profiler's table by GPU self time — a call whose CPU
total exceeds its GPU total is bound by launches and Python, not by the GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from vitconvert.attention import VARIANTS
from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.settings import KernelSettings, config_setting


def make_step(mix, leaves: list[torch.Tensor], grad: torch.Tensor, infer: bool):
    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.set_grad_enabled(not infer):
            out = mix(*leaves)
        if not infer:
            out.backward(grad)
    return step


def cuda_ms(step, calls: int = 20) -> float:
    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def sweep(name: str, q, k, v, grad, side: int, infer: bool) -> int:
    """ms per call of ``name``'s mix under each (BLOCK_N, num_warps) and tile type, and of SDPA for scale."""
    heads, d = q.shape[1], q.shape[-1]
    module = VARIANTS[name](heads * d, heads, num_prefix_tokens=1, grid_size=(side, side)).to(q.device)
    mix = lambda q, k, v: module.mix(q, k, v, None, (side, side))  # noqa: E731
    leaves = [t.detach().requires_grad_(not infer) for t in (q, k, v)]
    sdpa = cuda_ms(make_step(F.scaled_dot_product_attention, leaves, grad, infer))
    print(f"{name} N={q.shape[2]} B={q.shape[0]} {'forward' if infer else 'forward+backward'}: SDPA {sdpa:.3f} ms")
    for tile in ("tf32", "half"):
        for config in ("32,2", "32,4", "64,4", "64,8", "128,4", "128,8"):
            settings = KernelSettings(tile=tile, config=config_setting(config))
            try:
                with dispatch.kernels_on(settings=settings):
                    ms = cuda_ms(make_step(mix, leaves, grad, infer))
                print(f"  tile {tile:4s} BLOCK_N,warps {config:6s}: {ms:.3f} ms  ({sdpa / ms:.2f}× SDPA)")
            except Exception as e:  # a configuration the compiler refuses (registers, shared memory)
                print(f"  tile {tile:4s} BLOCK_N,warps {config:6s}: {type(e).__name__}: {str(e)[:80]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4097, help="N: a class token and a square grid")
    parser.add_argument("--shape", default="16,6,64", help="batch,heads,head dim")
    parser.add_argument("--infer", action="store_true", help="forward only (default: forward + backward)")
    parser.add_argument("--variants", default=",".join(["softmax", *VARIANTS]))
    parser.add_argument("--rows", type=int, default=12, help="rows of each profile table")
    parser.add_argument("--sweep", default=None, help="time this variant under each launch configuration "
                                                      "(VITCONVERT_FUSED_CONFIG, VITCONVERT_FUSED_TILE) instead")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: profile_mix needs a CUDA GPU", file=sys.stderr)
        return 2
    batch, heads, d = (int(x) for x in args.shape.split(","))
    side = int(round((args.tokens - 1) ** 0.5))
    device = torch.device("cuda")
    q, k, v, grad = (torch.randn(batch, heads, args.tokens, d, device=device, dtype=torch.bfloat16)
                     for _ in range(4))
    if args.sweep:
        return sweep(args.sweep, q, k, v, grad, side, args.infer)
    for name in args.variants.split(","):
        if name == "softmax":
            mix = F.scaled_dot_product_attention
        else:
            module = VARIANTS[name](heads * d, heads, num_prefix_tokens=1, grid_size=(side, side)).to(device)
            mix = lambda q, k, v, m=module: m.mix(q, k, v, None, (side, side))  # noqa: E731
        leaves = [t.detach().requires_grad_(not args.infer) for t in (q, k, v)]
        step = make_step(mix, leaves, grad, args.infer)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        calls = 10
        began = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - began) / calls * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
        print(f"\n{name}: N={args.tokens} {'forward' if args.infer else 'forward+backward'}: {wall:.3f} ms/call "
              f"(wall, unprofiled); profile of {calls} calls:")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows,
                                        max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
