"""TTT's step recomputed in backward: what a training forward keeps, the same values and gradients as the step
recorded whole, and where the recomputation stays out (inference, export, tracing)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vitconvert.attention import ttt

from .helpers import make_module, random_mask, random_qkv


def trained_module(num_prefix: int, grid, dtype: torch.dtype = torch.float64) -> ttt.TTTAttention:
    """A TTT module whose fast weights and convs are large enough that every part of the step matters."""
    mod = make_module("ttt", num_prefix, grid, dim=8, heads=2, dtype=dtype, inner_lr=0.7)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(std=0.5, generator=torch.Generator().manual_seed(3))
    return mod


def saved_storages(fn, *args) -> set[int]:
    """The storages autograd keeps for backward from ``fn(*args)``."""
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().nbytes():  # (torch 2.11's checkpoint saves an empty placeholder: no memory)
            saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return saved


@pytest.mark.parametrize("grid,num_prefix,masked", [((4, 4), 1, True), ((4, 4), 0, False), (None, 2, True)])
def test_recomputed_step_gives_the_step_values_and_gradients_bitwise(grid, num_prefix, masked):
    mod = trained_module(num_prefix, grid)
    tokens = num_prefix + (grid[0] * grid[1] if grid else 7)
    key_valid = random_mask(2, tokens) if masked else None
    params = [p for p in mod.parameters() if p.requires_grad]
    results = []
    for recompute in (True, False):
        mod.recompute_step = recompute
        q, k, v = (t.requires_grad_() for t in random_qkv(2, mod.num_heads, tokens, mod.head_dim))
        out = mod.mix(q, k, v, key_valid, grid)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
        results.append((out, *torch.autograd.grad((out * probe).sum(), [q, k, v, *params], allow_unused=True)))
    for got, want in zip(*results, strict=True):
        if want is None:  # the convs' parameters without a grid
            assert got is None
            continue
        assert torch.equal(got, want)


def tiny_ttt_student() -> tuple[torch.nn.Module, torch.Tensor]:
    """A 2-block TTT ViT converted from a random tiny timm ViT, and a batch of 32 px images for it."""
    import timm

    import vitconvert

    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                               num_heads=3, depth=2, num_classes=5)
    student, _ = vitconvert.convert(source, "ttt")
    return student, torch.randn(2, 3, 32, 32)


def test_a_whole_model_trains_the_same_with_the_step_recomputed():
    """bf16 autocast, as a training step runs: the same loss and the same gradient of every parameter."""
    student, images = tiny_ttt_student()
    runs = []
    for recompute in (True, False):
        for m in student.modules():
            if isinstance(m, ttt.TTTAttention):
                m.recompute_step = recompute
        student.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = student(images).float().square().mean()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters()}))
    (loss_on, grads_on), (loss_off, grads_off) = runs
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys()
    for name, grad in grads_off.items():
        assert torch.equal(grads_on[name], grad), name


def test_a_training_forward_keeps_only_q_k_v():
    mod = trained_module(1, (4, 4))
    qkv = torch.randn(2, 17, 3, 2, 4, dtype=torch.float64, requires_grad=True) * 1.0  # one projection's output
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    key_valid = random_mask(2, 17)
    kept = {qkv.untyped_storage().data_ptr(), key_valid.untyped_storage().data_ptr()}  # and the (B, N) mask
    assert saved_storages(mod.mix, q, k, v, key_valid, (4, 4)) == kept
    mod.recompute_step = False  # recorded whole, the step keeps its intermediates (what the recomputation saves)
    assert len(saved_storages(mod.mix, q, k, v, key_valid, (4, 4))) > 10


class RecordedOps(TorchDispatchMode):
    """The aten ops a region runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("form", ["step", "bf16_mix"])
def test_the_step_draws_no_random_numbers(form):
    """So the recomputation needs no stashed RNG state (``preserve_rng_state=False``): no seeded op runs in the
    step's forward or backward, in either form, and the generator is where it was."""
    mod = trained_module(1, (4, 4), dtype=torch.float32)
    dtype = torch.float32 if form == "step" else torch.bfloat16
    q, k, v = (t.to(dtype).requires_grad_() for t in random_qkv(2, mod.num_heads, 17, mod.head_dim))
    key_valid = random_mask(2, 17)
    before = torch.get_rng_state()
    with RecordedOps() as recorded:
        out = getattr(mod, form)(q, k, v, key_valid, (4, 4))
        out.float().sum().backward()
    assert recorded.ops and not [f for f in recorded.ops if torch.Tag.nondeterministic_seeded in f.tags]
    assert torch.equal(torch.get_rng_state(), before)


@pytest.fixture
def checkpoint_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    recompute = ttt.checkpoint

    def counted(*args, **kwargs):
        calls.append(1)
        return recompute(*args, **kwargs)

    monkeypatch.setattr(ttt, "checkpoint", counted)
    return calls


def test_only_a_forward_that_records_for_backward_recomputes(checkpoint_calls):
    mod = trained_module(1, (4, 4))
    x = torch.randn(2, 17, 8, dtype=torch.float64)
    with torch.no_grad():
        plain = mod(x)
    with torch.inference_mode():
        mod(x)
    assert not checkpoint_calls
    mod.recompute_step = False
    mod(x)
    assert not checkpoint_calls
    mod.recompute_step = True
    out = mod(x)
    assert len(checkpoint_calls) == 1
    # Not bitwise: with grad enabled ATen may pick another matmul path than under no_grad on some CPUs.
    torch.testing.assert_close(out, plain, atol=1e-12, rtol=1e-10)


def test_traces_for_export_and_torchscript_record_the_plain_step(checkpoint_calls):
    mod = trained_module(1, (4, 4)).float()
    x = torch.randn(2, 17, 8)
    program = torch.export.export(mod, (x,))
    targets = {str(node.target) for node in program.graph.nodes}
    assert not [t for t in targets if "checkpoint" in t]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trace's deprecation and its constant-grid warnings
        traced = torch.jit.trace(mod, x)
    torch.testing.assert_close(traced(x), mod(x))
    assert len(checkpoint_calls) == 1  # the last call, eager with grad on


def test_a_compiled_training_step_keeps_the_recomputation_in_one_graph():
    """torch.compile(fullgraph=True) over a converted model: the step stays a checkpointed region (dynamo's
    activation-checkpoint op) in a single graph, with the eager model's loss and gradients."""
    torch._dynamo.reset()
    student, images = tiny_ttt_student()
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    runs = []
    for model in (torch.compile(student, fullgraph=True, backend=keep_graph), student):
        student.zero_grad()
        loss = model(images).square().mean()
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in student.parameters()]))
    assert len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert sum("checkpoint" in t for t in targets) == 2, targets  # one per block
    (compiled_loss, compiled_grads), (loss, grads) = runs
    torch.testing.assert_close(compiled_loss, loss)
    for got, want in zip(compiled_grads, grads, strict=True):
        torch.testing.assert_close(got, want)
