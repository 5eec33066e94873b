"""Passes over memory without a GPU: the aten ops of one forward of a converted model, and the bytes they move.

    python benchmarks/op_traffic.py                        # TTT in vit_small at 224 px, 2 blocks, batch 2
    python benchmarks/op_traffic.py --variant mhla --img-size 512 --by-op
    python benchmarks/op_traffic.py --train                # a training step: forward and backward
    python benchmarks/op_traffic.py --variant mhla --train --cuda-norms   # CUDA's fused RMSNorm as one op each
    python benchmarks/op_traffic.py --passes --variants mhla,ttt --json benchmarks/results/op-traffic-passes.json
    python benchmarks/op_traffic.py --passes --batch 16 --sizes-only   # the kernels counted, not run: seconds

A TorchDispatchMode records every aten op one forward runs (views left out: they move no data), with the bytes
it reads (its tensor inputs) and writes (its outputs), and marks those inside the attention layers' token mixing
(``mix``). Token-sized ops touch a tensor at least as large as q: the passes over N-sized memory that bound an
O(N) layer on a GPU. Two forms: float32 (the eager form: the CPU's, and the reference), and bf16 autocast on the
GPU path (the fused kernels in Triton's interpreter, each one op; TTT's bf16 form), as a GPU runs them. The ops
are the same on any device; their times are not measured here. ``--cuda-norms``: MHLA's RMSNorm of q and k as it
runs on CUDA, torch's fused kernels (aten::_fused_rms_norm and its backward, one op each there), which the CPU
lacks (its forward decomposes into seven ops; its backward has no CPU kernel): CPU stand-ins doing their math. Both
MHLA ops now normalise q and k in their kernels both ways, so it changes only their eager fallbacks' counts.

``--passes``: the table of issue 37's item 5, HBM bytes of the token mixing per layer in one training step
(forward and backward, on the bf16 GPU path with CUDA's norms) in q-sized passes (q's bytes in bf16), each variant
against softmax's SDPA (its forward and backward ops). A fused op's body is counted inside (its torch ops and the
tensor arguments of its Triton launches), not as the op's own inputs and outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Optional

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

if __name__ == "__main__" and not torch.cuda.is_available():  # the CPU's kernels: set before timm imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import timm  # noqa: E402

import vitconvert  # noqa: E402
from vitconvert.attention import VARIANTS, LinearAttention  # noqa: E402
from vitconvert.attention.ops import dispatch  # noqa: E402
from vitconvert.attention.ops.linear.launches import tickets  # noqa: E402
from vitconvert.attention.ops.norms import lean as lean_norms  # noqa: E402
from vitconvert.writer import write_text_atomic  # noqa: E402


def moved_bytes(t: torch.Tensor) -> int:
    """Bytes an op reads or writes of ``t``: its elements, at most its storage (a broadcast reads each once)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


ALLOCATIONS = {"empty.memory_format", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


def aliases(func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    """A view: new metadata over an input's storage, no data moved (also ``_unsafe_view``, which matmul's
    reshapes use and the schema does not mark as a view), or an allocation (memory, no data); an in-place op
    moves data and counts."""
    if func.is_view or func.name().removeprefix("aten::") in ALLOCATIONS:
        return True
    if func._schema.is_mutable or not outputs:
        return False
    held = {t.untyped_storage().data_ptr() for t in inputs}
    return all(t.untyped_storage().data_ptr() in held for t in outputs)


class Traffic:
    """The ops of a region: how many, how many token-sized, and the bytes they move, with a count per op name."""

    def __init__(self) -> None:
        self.ops, self.token_sized, self.bytes = 0, 0, 0
        self.by_op: Counter = Counter()
        self.token_sized_by_op: Counter = Counter()
        self.bytes_by_op: Counter = Counter()

    def add(self, name: str, moved: int, large: bool) -> None:
        self.ops += 1
        self.token_sized += large
        self.bytes += moved
        self.by_op[name] += 1
        self.token_sized_by_op[name] += large
        self.bytes_by_op[name] += moved


class OpTraffic(TorchDispatchMode):
    """Records every aten op that moves data: into ``model``, and into ``mixing`` while ``in_mix`` is set."""

    def __init__(self, token_sized: int, sdpa_mixing: bool = False) -> None:
        super().__init__()
        self.sdpa_mixing = sdpa_mixing  # softmax's token mixing: SDPA's ops, forward and backward (--passes)
        self.into_fused_ops = False  # count a fused op's body (count() sets it: its launches run unrecorded)
        self.token_sized = token_sized  # elements of q: an op touching a tensor this large is a pass over tokens
        self.model, self.mixing, self.kernels = Traffic(), Traffic(), Traffic()
        self.mixing_kernels = Traffic()  # the launches inside the token mixing (forward and, marked, backward)
        self.in_mix = False
        self.run_kernels = True  # False: each launch counted, not run (its outputs stay uninitialised)
        self.forward_ops = (0, 0)  # the mixing's torch ops and launches when the forward ended (count())

    def launch(self, kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
        """A Triton launch inside a fused op (dispatch.launches_through): the bytes of its tensor arguments, each
        tensor once (a placeholder for an absent mask or index is another argument's tensor), then the launch.
        What the op's own inputs and outputs do not show: the float32 d×d states the blocked kernels write and
        read (MHLA's: larger than its tokens at 224 px)."""
        seen = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()): t for t in args
                if isinstance(t, torch.Tensor)}
        moved = sum(moved_bytes(t) for t in seen.values())
        large = max((t.numel() for t in seen.values()), default=0) >= self.token_sized
        self.kernels.add(dispatch.kernel_name(kernel), moved, large)
        if self.in_mix:
            self.mixing_kernels.add(dispatch.kernel_name(kernel), moved, large)
        if not self.run_kernels:
            return None
        with _disable_current_modes():  # (the interpreter's copies to and from its host buffers: not the GPU's)
            return dispatch.build_and_run(kernel, grid, *args, **kwargs)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if self.into_fused_ops and func.namespace == "vitconvert":  # a fused op: its body's ops and launches
            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not aliases(func, inputs, outputs):
            tensors = inputs + outputs
            if tensors:
                moved = sum(moved_bytes(t) for t in tensors)
                large = max(t.numel() for t in tensors) >= self.token_sized
                name = func.name().removeprefix("aten::")
                self.model.add(name, moved, large)
                if self.in_mix or (self.sdpa_mixing and "scaled_dot_product" in name):
                    self.mixing.add(name, moved, large)
        return out


@contextmanager
def marked_mixing(model: torch.nn.Module, recorder: OpTraffic) -> Iterator[None]:
    """Each attention layer's ``mix`` sets ``recorder.in_mix`` while it runs, and while its backward runs: from
    when its output's gradient is ready until the gradients of all its q, k, v inputs are (tensor hooks; autograd
    runs the nodes made later first, so nothing made before the mix runs in between)."""
    layers = [m for m in model.modules() if isinstance(m, LinearAttention)]

    def marked(layer: LinearAttention) -> Any:
        mix = layer.mix

        def mix_marked(*args: Any) -> torch.Tensor:
            recorder.in_mix = True
            try:
                out = mix(*args)
            finally:
                recorder.in_mix = False
            inputs = [t for t in args[:3] if isinstance(t, torch.Tensor) and t.requires_grad]
            if out.requires_grad and inputs:
                mark_backward(out, inputs)
            return out

        def mark_backward(out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
            waiting = [len(inputs)]

            def begin(grad: torch.Tensor) -> None:
                recorder.in_mix = True

            def end(grad: torch.Tensor) -> None:
                waiting[0] -= 1
                recorder.in_mix = waiting[0] > 0

            out.register_hook(begin)
            for t in inputs:
                t.register_hook(end)
        return mix_marked

    for layer in layers:
        layer.mix = marked(layer)  # an instance attribute over the method, removed below
    try:
        yield
    finally:
        for layer in layers:
            del layer.mix


def rms_norm_on_the_cpu(input: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor],
                         eps: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """aten::_fused_rms_norm's math (float32 inside, output in the input's dtype, float32 rstd), one op."""
    x = input.float()
    rstd = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + (torch.finfo(input.dtype).eps if eps is None else eps))
    out = x * rstd
    return (out if weight is None else out * weight.float()).to(input.dtype), rstd


def rms_norm_backward_on_the_cpu(grad: torch.Tensor, input: torch.Tensor, normalized_shape: list[int],
                                  rstd: torch.Tensor, weight: Optional[torch.Tensor],
                                  output_mask: list[bool]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """aten::_fused_rms_norm_backward's math (dinput, dweight), one op."""
    x_hat, g = input.float() * rstd, grad.float() * (1.0 if weight is None else weight.float())
    dx = rstd * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    dweight = None if weight is None else (grad.float() * x_hat).flatten(0, -2).sum(0).to(weight.dtype)
    return dx.to(input.dtype), dweight


@contextmanager
def cuda_norm_kernels() -> Iterator[None]:
    """MHLA's RMSNorm on its CUDA branch, torch's fused kernels registered for the CPU (removed on exit)."""
    if not lean_norms.FUSED_RMS_BACKWARD:
        raise SystemExit("error: --cuda-norms: this torch has no aten::_fused_rms_norm_backward")
    devices = dispatch.current().rms_norm_devices
    with torch.library._scoped_library("aten", "IMPL") as library:
        library.impl("_fused_rms_norm", rms_norm_on_the_cpu, "CPU")
        library.impl("_fused_rms_norm_backward", rms_norm_backward_on_the_cpu, "CPU")
        with dispatch.kernels_on(rms_norm_devices=(*devices, "cpu")):
            yield


def count(model: torch.nn.Module, images: torch.Tensor, form: str, token_sized: int, train: bool = False,
          sdpa_mixing: bool = False, run_kernels: bool = True) -> OpTraffic:
    """One forward of ``model`` in ``form`` ('float32' or 'bf16') without grad, or with ``train`` one training step
    (forward and backward of the logits' mean, from no gradients), every op recorded; without ``run_kernels`` the
    Triton launches are counted and not run (the counts take sizes only: the same counts, in seconds, not minutes)."""
    recorder = OpTraffic(token_sized, sdpa_mixing)
    recorder.into_fused_ops, recorder.run_kernels = True, run_kernels
    model.zero_grad(set_to_none=True)
    with ExitStack() as stack:
        stack.enter_context(torch.enable_grad() if train else torch.no_grad())
        stack.enter_context(dispatch.launches_through(recorder.launch, images.device.type))
        stack.enter_context(marked_mixing(model, recorder))
        stack.enter_context(recorder)
        with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=form == "bf16"):
            logits = model(images)
        recorder.forward_ops = (recorder.mixing.ops, recorder.mixing_kernels.ops)
        if train:
            logits.float().mean().backward()
    model.zero_grad(set_to_none=True)
    return recorder


def mixing_passes(model: torch.nn.Module, images: torch.Tensor, q_bytes: int, layers: int,
                  run_kernels: bool = True, programs: Optional[int] = None) -> dict[str, Any]:
    """HBM bytes of the token mixing per layer in one bf16 training step on the GPU path (its torch ops and its
    launches' tensor arguments, forward and backward; softmax: SDPA's ops) over q's bytes: q-sized passes, and
    those of each op or kernel (by name), the token-sized ops and launches among them, and the launches and torch
    ops of each direction; ``programs``: those a launch wants before heads split over token ranges (a GPU's: 4 an
    SM; None: the CPU's one, no split)."""
    with gpu_path(), dispatch.kernels_on(programs=programs):
        recorder = count(model, images, "bf16", q_bytes // 2, train=True, sdpa_mixing=True, run_kernels=run_kernels)
    by_op = {**recorder.mixing.bytes_by_op, **recorder.mixing_kernels.bytes_by_op}
    scale = 1 / layers / q_bytes
    ops, launches = recorder.forward_ops
    return {"q_sized_passes": (recorder.mixing.bytes + recorder.mixing_kernels.bytes) * scale,
            "by_op": {name: round(moved * scale, 2) for name, moved in sorted(by_op.items(), key=lambda kv: -kv[1])},
            "token_sized_ops": (recorder.mixing.token_sized + recorder.mixing_kernels.token_sized) / layers,
            "launches": {"forward": launches / layers, "backward": (recorder.mixing_kernels.ops - launches) / layers},
            "torch_ops": {"forward": ops / layers, "backward": (recorder.mixing.ops - ops) / layers}}


@contextmanager
def gpu_path() -> Iterator[None]:
    """The bf16 GPU path on the CPU: the kernels in Triton's interpreter, CUDA's fused RMSNorm stood in."""
    with dispatch.kernels_on("cpu"), cuda_norm_kernels():
        yield


def pass_table(model_name: str, variants: list[str], img_size: int = 224, depth: int = 1, batch: int = 1,
               run_kernels: bool = True, programs: Optional[int] = None, **model_args: Any) -> dict[str, Any]:
    """Each of :func:`mixing_passes`'s numbers as {variant: number} for softmax and each variant, with the
    setting."""
    torch.manual_seed(0)
    source = timm.create_model(model_name, pretrained=False, img_size=img_size, depth=depth, **model_args)
    images = torch.randn(batch, 3, img_size, img_size)
    tokens = source.patch_embed.num_patches + source.num_prefix_tokens
    q_bytes = batch * tokens * source.embed_dim * 2  # bf16
    tickets(1, images.device)  # (the split kernels' counters: made once a process, so no variant's count takes them)
    print(f"counting softmax at {tokens} tokens, batch {batch}", file=sys.stderr, flush=True)  # (minutes at 4097)
    rows = {"softmax": mixing_passes(source, images, q_bytes, depth, run_kernels, programs)}
    for name in variants:
        print(f"counting {name}", file=sys.stderr, flush=True)
        student, _ = vitconvert.convert(source, name)
        rows[name] = mixing_passes(student, images, q_bytes, depth, run_kernels, programs)
    return {"model": model_name, "img_size": img_size, "tokens": tokens, "depth": depth, "batch": batch,
            "model_args": model_args, "sizes_only": not run_kernels, **({"programs": programs} if programs else {}),
            **{key: {name: row[key] for name, row in rows.items()} for key in rows["softmax"]}}


def print_pass_table(table: dict[str, Any]) -> None:
    passes, launches, torch_ops = table["q_sized_passes"], table["launches"], table["torch_ops"]
    split = f", heads split as for {table['programs']} programs" if table.get("programs") else ""
    print(f"{table['model']} at {table['img_size']} px ({table['tokens']} tokens), batch {table['batch']}{split}: "
          "token mixing's HBM bytes per layer, one bf16 training step (GPU path), in q-sized passes; ops: its "
          "token-sized ops and launches; launches and torch ops forward + backward")
    print(f"  {'variant':8s} {'passes':>7s} {'× softmax':>10s} {'ops':>5s} {'launches':>9s} {'torch ops':>10s}   "
          "largest by op or kernel (passes)")
    for name, value in passes.items():
        runs, ops = launches[name], torch_ops[name]
        print(f"  {name:8s} {value:7.1f} {value / passes['softmax']:10.2f} {table['token_sized_ops'][name]:5.0f} "
              f"{runs['forward']:4.0f} +{runs['backward']:3.0f} {ops['forward']:5.0f} +{ops['backward']:3.0f}   "
              + ", ".join(f"{op} {moved:.1f}" for op, moved in list(table["by_op"][name].items())[:6]))
    print(f"  ({table['cpu_s']:.0f} CPU-s)")


def report(name: str, recorder: OpTraffic, layers: int, by_op: bool) -> None:
    mib = 2 ** 20
    mixing, whole = recorder.mixing, recorder.model
    line = f"  {name}: model {whole.ops} ops ({whole.token_sized} token-sized), {whole.bytes / mib:.1f} MiB"
    launches = recorder.mixing_kernels
    if mixing.ops or launches.ops:  # (softmax has no token mixing of ours: SDPA is one op of the model)
        line += (f"; token mixing's forward per layer {mixing.ops / layers:.0f} ops "
                 f"({mixing.token_sized / layers:.0f} token-sized), {mixing.bytes / layers / mib:.2f} MiB")
        if launches.ops:  # (a fused op's launches: TTT's whole step is one)
            line += f" and {launches.ops / layers:.0f} launches, {launches.bytes / layers / mib:.2f} MiB"
    print(line)
    kernels = recorder.kernels
    if kernels.ops:  # (inside the fused ops, which the line above counts by their inputs and outputs)
        print(f"    inside its fused ops: {kernels.ops} Triton launches, {kernels.bytes / mib:.1f} MiB of their tensor "
              f"arguments")
    if by_op:
        for op, n in sorted(mixing.by_op.items(), key=lambda kv: -mixing.bytes_by_op[kv[0]]):
            print(f"      {op:30s} {n / layers:5.1f}× ({mixing.token_sized_by_op[op] / layers:4.1f} token-sized) "
                  f"{mixing.bytes_by_op[op] / layers / mib:8.2f} MiB")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224", help="timm name (random init)")
    parser.add_argument("--variant", default="ttt")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--by-op", action="store_true", help="the token mixing's ops by name, per layer")
    parser.add_argument("--train", action="store_true", help="a training step (forward and backward), not a forward")
    parser.add_argument("--cuda-norms", action="store_true",
                        help="the bf16 GPU path's RMSNorm (MHLA) as torch's fused CUDA kernels, one op each")
    parser.add_argument("--passes", action="store_true", help="the table of q-sized passes per variant (--variants)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the variants of --passes, comma-separated")
    parser.add_argument("--json", help="--passes: also write the table to this JSON file")
    parser.add_argument("--sizes-only", action="store_true",
                        help="count each Triton launch without running it in the interpreter (the counts take sizes "
                             "only; the kernels' outputs are left uninitialised)")
    parser.add_argument("--programs", type=int, help="--passes: programs a launch wants before heads split over "
                        "token ranges, as on a GPU (4 an SM: 528 on an H100 or H200); default the CPU's 1, no split")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.passes else [args.variant]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"error: unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if args.passes:
        started = time.process_time()
        table = pass_table(args.model, variants, args.img_size, args.depth, args.batch, not args.sizes_only,
                           args.programs)
        table["cpu_s"] = round(time.process_time() - started, 1)  # this process's (its threads', not the children's)
        print_pass_table(table)
        if args.json:
            write_text_atomic(Path(args.json), json.dumps(table, indent=1) + "\n")
        return 0
    torch.manual_seed(0)
    source = timm.create_model(args.model, pretrained=False, img_size=args.img_size, depth=args.depth)
    student, _ = vitconvert.convert(source, args.variant)
    images = torch.randn(args.batch, 3, args.img_size, args.img_size)
    first = next(m for m in student.modules() if isinstance(m, LinearAttention))
    tokens = student.patch_embed.num_patches + first.num_prefix_tokens
    token_sized = args.batch * first.attn_dim * student.patch_embed.num_patches  # q on the grid (the convs)
    print(f"{args.variant} in {args.model} at {args.img_size} px ({tokens} tokens), {args.depth} blocks, "
          f"batch {args.batch}: aten ops of {'a training step' if args.train else 'one forward'} (views left out)")
    for form, name in (("float32", "float32"), ("bf16", "bf16 GPU path")):
        norms, kernels = nullcontext(), nullcontext()
        if form == "bf16":
            kernels = dispatch.kernels_on("cpu")  # the GPU path, the kernels in Triton's interpreter
            if args.cuda_norms:
                name, norms = name + " (CUDA's fused RMSNorm)", cuda_norm_kernels()
        with kernels, norms:
            run = not args.sizes_only
            report(f"softmax, {name}", count(source, images, form, token_sized, args.train, run_kernels=run),
                   args.depth, False)
            report(f"{args.variant}, {name}", count(student, images, form, token_sized, args.train, run_kernels=run),
                   args.depth, args.by_op)
    return 0


if __name__ == "__main__":
    sys.exit(main())
