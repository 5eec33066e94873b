"""What tests share (imported as ``from helpers import ...``; conftest.py holds only fixtures and session setup):
tiny pretrained=False models of every timm ViT family the surgery supports, a Hub cache layout, and the CLI
runner with the one-line-error check every command's bad input must pass."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import timm
import torch
from huggingface_hub import HfApi
from typer.testing import CliRunner

runner = CliRunner()


@functools.cache
def load_benchmark(name: str) -> types.ModuleType:
    """benchmarks/<name>.py as a module (benchmarks/ is not a package), loaded once per process and registered in
    sys.modules first, as its dataclasses need; its folder on sys.path, as when it runs, for the modules beside it."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def invoke(*args: str, **kwargs):
    """``vitconvert ARGS...`` in this process (typer's runner), stdout and stderr kept apart."""
    from vitconvert.cli import app

    return runner.invoke(app, [str(a) for a in args], **kwargs)


TINY = dict(embed_dim=32, num_heads=2, depth=2)
# family -> (timm name, kwargs giving a model of a few hundred kB at 32 px)
FAMILIES: dict[str, tuple[str, dict]] = {
    "vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, **TINY)),
    "vit_reg_gap": ("vit_base_patch16_reg4_gap_256", dict(img_size=32, patch_size=8, **TINY)),
    "vit_qknorm": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, qk_norm=True, **TINY)),
    "clip": ("vit_base_patch16_clip_224", dict(img_size=32, patch_size=8, **TINY)),
    "siglip": ("vit_base_patch16_siglip_224", dict(img_size=32, patch_size=8, **TINY)),
    "dinov2": ("vit_small_patch14_reg4_dinov2", dict(img_size=28, patch_size=7, **TINY)),
    "deit3": ("deit3_small_patch16_224", dict(img_size=32, patch_size=8, **TINY)),
    "deit_distilled": ("deit_tiny_distilled_patch16_224", dict(img_size=32, patch_size=8, **TINY)),
    "eva02": ("eva02_tiny_patch14_224", dict(img_size=28, patch_size=7, num_classes=10, **TINY)),
    "dinov3": ("vit_base_patch16_dinov3", dict(img_size=32, patch_size=8, **TINY)),
    "pe": ("vit_pe_core_tiny_patch16_384", dict(img_size=32, patch_size=8, **TINY)),
    "beit": ("beit_base_patch16_224", dict(img_size=32, patch_size=8, **TINY)),
    "relpos": ("vit_relpos_small_patch16_224", dict(img_size=32, patch_size=8, **TINY)),
    "srelpos": ("vit_srelpos_small_patch16_224", dict(img_size=32, patch_size=8, **TINY)),
    "naflex": ("naflexvit_base_patch16_gap", dict(**TINY)),
}


def tiny_model(family: str = "vit", **overrides) -> torch.nn.Module:
    name, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **{**kwargs, **overrides}).eval()


def image_batch(model: torch.nn.Module, batch: int = 2) -> torch.Tensor:
    size = model.pretrained_cfg.get("input_size", (3, 32, 32))[-1]
    size = getattr(getattr(model, "patch_embed", None), "img_size", (size, size))[0] if hasattr(
        model, "patch_embed") and getattr(model.patch_embed, "img_size", None) else 32
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def place_in_hub_cache(cache: os.PathLike, repo_id: str, folder: os.PathLike, revision: str = "main") -> str:
    """Lay ``folder`` out as huggingface_hub's cache does (blobs, snapshots/<sha>, refs/<revision>)."""
    import hashlib
    import shutil
    from pathlib import Path

    root = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    sha = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = root / "snapshots" / sha
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in Path(folder).iterdir():
        if f.is_file():
            blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, blob)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(sha)
    return sha


def hold_lock(out: Path, host: str = "") -> subprocess.Popen:
    """Another live process holding ``out``'s output lock as a running vitconvert command does (an OS lock on
    ``.NAME.lock``, its host and pid written in it), once it holds it; ``host``: the host name it writes (this
    one's by default). Kill it to play a crash."""
    from vitconvert.writer import _tag

    code = ("import os, sys, time\nfrom filelock import FileLock\npath, host = sys.argv[1:]\n"
            "lock = FileLock(path, timeout=0)\nlock.acquire()\n"
            "open(path, 'w').write(f'{host} {os.getpid()}\\n')\nprint('held', flush=True)\ntime.sleep(120)\n")
    lock = out.parent / f".{out.name}.lock"
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock), host or _tag().rsplit("-", 1)[0]],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def assert_one_line_error(result, text: str) -> None:
    """A CLI failure as users must see it: non-zero exit, exactly one `error: ...` line, no traceback."""
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert text in lines[0], lines[0]
    assert "Traceback" not in result.output + result.stderr


FAKE_TOKEN = "hf_FakeTokenForTests0123456789abcdef"


class FakeHub:
    """Records what reaches huggingface_hub; ``fail`` makes the named call raise."""

    def __init__(self, monkeypatch, fail: dict | None = None):
        self.calls: list[tuple[str, tuple, dict]] = []
        self.fail = fail or {}
        for name in ("create_repo", "create_branch", "upload_folder"):
            monkeypatch.setattr(HfApi, name, self._record(name))

    def _record(self, name):
        def method(api, *args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name in self.fail:
                raise self.fail[name]
            return type("CommitInfo", (), {"commit_url": "https://huggingface.co/me/x/commit/abc"})()
        return method

    def kwargs(self, name: str) -> dict:
        return next(kw for n, _, kw in self.calls if n == name)


def interpreter_rounds_to_nearest() -> bool:
    """Make Triton's interpreter cast float32 to bfloat16 as the GPU does, rounding to nearest even (it
    truncates: triton/runtime/interpreter.py's ``_convert_float``, called without a rounding mode). Truncation
    is biased, and the bias adds up over the kernels' sums: TTT's backward on 16-bit tiles measured 0.023
    against float64 with it, 0.005 without (plain autocast: 0.007). Returns False where this triton has no such
    function (tests/attention/test_interpreter.py then fails, saying so)."""
    import numpy as np  # lazy: start-up time (only where the interpreter runs)
    import triton.language as tl  # lazy: start-up time
    from triton.runtime import interpreter  # lazy: start-up time

    truncating = getattr(interpreter, "_convert_float", None)
    if truncating is None or getattr(truncating, "rounds_to_nearest", False):
        return truncating is not None

    def convert(data, from_type, to_type, rounding_mode):
        if from_type == tl.float32 and to_type == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return truncating(data, from_type, to_type, rounding_mode)

    convert.rounds_to_nearest = True
    interpreter._convert_float = convert
    return True


def interpreter_patches_once() -> bool:
    """Make Triton's interpreter patch triton.language once per launch. It patches the language modules (every
    builtin found by inspect.getmembers, then the tensor class) when a kernel starts, and again at every call of a
    @triton.jit helper inside it, though nothing has changed since: a tenth or more of a fused test's CPU time.
    Inside a launch, a helper that sees no language module the launch has not patched now skips the repeat (the same
    functions stay in place); every other call patches as before. Returns False where this triton differs."""
    import inspect  # lazy: start-up time (only where the interpreter runs)

    import triton.language as tl  # lazy: start-up time
    from triton.runtime import interpreter  # lazy: start-up time

    patch, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or launch is None:
        return False
    if getattr(patch, "once_per_launch", False):
        return True
    patched: list[set[int]] = []  # per launch running (one), the language modules (ids) it has patched
    seen: dict[object, frozenset[int]] = {}  # per jit'd function, the language modules its module imports

    def patch_once(fn):
        langs = seen.get(fn)
        if langs is None:
            modules = (v for v in fn.__globals__.values() if inspect.ismodule(v))
            langs = seen[fn] = frozenset(id(v) for v in modules if v in (tl, tl.core))
        if patched and langs and langs <= patched[-1]:
            return None  # a helper's call inside the launch (its caller ignores the scope)
        scope = patch(fn)
        if patched:
            patched[-1] |= langs
        return scope

    def run(self, *args, **kwargs):
        patched.append(set())
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            patched.pop()

    run_launch = launch.__call__
    patch_once.once_per_launch = True
    interpreter._patch_lang, launch.__call__ = patch_once, run
    return True


# CUDA's autocast casting lists (torch's ATen/autocast_mode.h) that the CPU's autocast lacks, by policy: float32
# (fp32), float32 unless a dtype is given (fp32_set_opt_dtype), the widest input type (promote), the autocast dtype
# (lower_precision_fp). The loss functions and upsampling of the float32 list are left out (no layer runs them).
CUDA_AUTOCAST = {
    "fp32": ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
             "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
             "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "cosine_similarity",
             "dist", "cdist", "renorm", "logsumexp"),
    "fp32_set_opt_dtype": ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                           "linalg_vector_norm", "sum", "sum.dim_IntList"),
    "promote": ("addcdiv", "addcmul", "atan2", "cross", "dot", "vdot", "tensordot", "scatter_add", "index_put"),
    "lower_precision_fp": ("einsum", "addmv", "addr", "mv", "chain_matmul", "linalg_multi_dot", "convolution"),
}


def _cuda_autocast_kernel(op, policy: str):
    """A kernel for the CPU's autocast key that casts as CUDA's does for ``policy``, then runs ``op`` below it."""
    from torch.utils._pytree import tree_leaves, tree_map  # lazy: start-up time

    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def eligible(t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64

    def kernel(*args, **kwargs):
        low = torch.get_autocast_dtype("cpu")
        if policy == "fp32_set_opt_dtype":
            target = None
            if eligible(args[0]) and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        elif policy == "promote":
            target = low
            for t in tree_leaves((args, kwargs)):
                if eligible(t):
                    target = torch.promote_types(target, t.dtype)
        else:
            target = torch.float32 if policy == "fp32" else low
        if target is not None:
            args, kwargs = tree_map(lambda t: t.to(target) if eligible(t) else t, (args, kwargs))
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*args, **kwargs)

    return kernel


@contextlib.contextmanager
def cuda_autocast_policy():
    """Within it, ``torch.autocast("cpu")`` casts as CUDA's autocast does (CUDA_AUTOCAST): the CPU's casts fewer ops
    (not F.rms_norm, sum, pow, rsqrt, addcmul…), so a forward the CPU's tests see in bf16 may run partly in float32
    on a GPU. Kernels registered for the CPU's autocast key, removed on exit."""
    with torch.library._scoped_library("aten", "IMPL") as lib:
        for policy, names in CUDA_AUTOCAST.items():
            for name in names:
                base, _, overload = name.partition(".")
                lib.impl(name, _cuda_autocast_kernel(getattr(getattr(torch.ops.aten, base), overload or "default"),
                                                     policy), "AutocastCPU")
        yield


def wait_until_torch_loads(proc: subprocess.Popen, limit_s: float = 60.0) -> None:
    """Until torch's libraries are mapped in ``proc`` (its command's imports under way), or a fixed pause where
    /proc is absent: a fixed pause alone can land inside Python's own start-up on a loaded machine, where SIGINT
    is Python's fatal error and no program's to handle."""
    maps = Path(f"/proc/{proc.pid}/maps")
    if not maps.exists():
        time.sleep(0.3)
        return
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if "libtorch" in maps.read_text():
                return
        except OSError:
            return
        time.sleep(0.01)
