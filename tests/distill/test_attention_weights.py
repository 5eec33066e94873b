"""Hedgehog's weight cross-entropy (``attn_loss: weight_ce``): the taps' weights and the loss against the formula
written out token by token, the gradient reaching φ's maps, teacher-forced inputs, the refusals, and a distill run
from the command line."""

from __future__ import annotations

import copy
import json
import math

import pytest
import timm
import torch
from helpers import assert_one_line_error, invoke

import vitconvert
from vitconvert.capture import DistillStudent, TeacherTap, attention_pairs
from vitconvert.distill.attention_weights import check_layers, weight_cross_entropy, weight_taps
from vitconvert.distill.losses import attention_loss
from vitconvert.distill.task import DistillationTask
from vitconvert.distill.teacher_cache import TeacherCache
from vitconvert.errors import VitconvertError
from vitconvert.recipes import build_recipe

from .helpers import CLI_FAST, counting_teacher, make_images, make_teacher

ARGS = dict(img_size=32, patch_size=8, embed_dim=32, num_heads=2, depth=2, num_classes=3)
STUDENTS = {"relu": ("relu", {}), "hedgehog": ("elu", {"feature_map": "hedgehog", "init_scale": 2.0})}


def pair(name: str):
    """A float64 teacher and its converted student (attention copied); Hedgehog's maps moved off their init, so a
    wrong W, b or q/k swap shows."""
    torch.manual_seed(0)
    teacher = timm.create_model("vit_tiny_patch16_224", pretrained=False, **ARGS).eval().double()
    variant, options = STUDENTS[name]
    student, _ = vitconvert.convert(teacher, variant, attn_init="copy", options=options or None)
    with torch.no_grad():
        for n, p in student.named_parameters():
            if "feature_map_" in n:
                p.add_(0.3 * torch.randn_like(p))
    return student.double(), teacher


def written_out(student_layer, teacher_layer, x_student, x_teacher) -> torch.Tensor:
    """One layer's −Σ_j a_ij log â_ij, the mean over images, heads and queries, token by token: a_ij the softmax of
    the teacher's q_i·k_j/√d over keys j, â_ij = φ(q_i)·φ(k_j) / (Σ_j φ(q_i)·φ(k_j) + ε) with the student's own q, k
    and φ (relu, or Hedgehog's [softmax(qW + b), softmax(−qW − b)])."""

    def qk(layer, x, b, h):
        d = layer.head_dim
        out = x[b] @ layer.qkv.weight.T + layer.qkv.bias
        width = x.shape[-1]
        return out[:, h * d:(h + 1) * d], out[:, width + h * d:width + (h + 1) * d]

    def phi(t, lin, h):
        if lin is None:
            return t.clamp_min(0)
        y = t @ lin.weight[h] + lin.bias[h]
        return torch.cat([y.exp() / y.exp().sum(), (-y).exp() / (-y).exp().sum()])

    rows = []
    B, N, _ = x_student.shape
    for b in range(B):
        for h in range(teacher_layer.num_heads):
            tq, tk = qk(teacher_layer, x_teacher, b, h)
            sq, sk = qk(student_layer, x_student, b, h)
            fk = [phi(sk[j], student_layer.feature_map_k, h) for j in range(N)]
            for i in range(N):
                logits = torch.stack([tq[i] @ tk[j] / math.sqrt(teacher_layer.head_dim) for j in range(N)])
                a = logits.exp() / logits.exp().sum()
                fq = phi(sq[i], student_layer.feature_map_q, h)
                scores = torch.stack([fq @ fk[j] for j in range(N)])
                rows.append(-(a * (scores / (scores.sum() + student_layer.eps)).clamp_min(1e-12).log()).sum())
    return torch.stack(rows).mean()


def layer_inputs(layers, run) -> list[torch.Tensor]:
    """Each layer's input in one call of ``run``, by a pre-hook of the test's own."""
    seen: list[torch.Tensor] = []
    handles = [m.register_forward_pre_hook(lambda m, args: seen.append(args[0])) for m in layers]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("name", list(STUDENTS))
def test_loss_is_the_weights_cross_entropy_written_out(name):
    student, teacher = pair(name)
    mine, theirs = attention_pairs(student, teacher)
    tap_mine, tap_theirs = weight_taps("weight_ce", mine, theirs)
    tap = TeacherTap(teacher, theirs, keep_inputs=True, tap=tap_theirs)
    wrapped = DistillStudent(student, mine, tap_mine)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    t_in = layer_inputs(theirs, lambda: teacher(x))
    s_in = layer_inputs(mine, lambda: student(x))
    _, t_weights, inputs = tap(x)
    _, s_weights = wrapped(x)
    assert [w.shape for w in s_weights] == [w.shape for w in t_weights] == [(2, 2, 17, 17)] * 2
    want = [written_out(m, t, si, ti) for m, t, si, ti in zip(mine, theirs, s_in, t_in, strict=True)]
    got = [weight_cross_entropy(s, t) for s, t in zip(s_weights, t_weights, strict=True)]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-10, rtol=0)
    loss = attention_loss(s_weights, t_weights, "weight_ce")  # float32, the mean over the layers
    torch.testing.assert_close(loss, torch.stack(want).mean().float(), atol=1e-5, rtol=1e-5)
    loss.backward()
    trained = [p for n, p in mine[1].named_parameters() if n.startswith(("qkv", "feature_map_"))]
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)
    # teacher-forced: the student's layer 1 on the teacher's layer-1 input
    _, forced = wrapped(x, forced=inputs, need_logits=False)
    torch.testing.assert_close(weight_cross_entropy(forced[1], t_weights[1]),
                               written_out(mine[1], theirs[1], t_in[1], t_in[1]), atol=1e-10, rtol=0)


def test_other_layers_are_refused_in_one_line():
    student, teacher = pair("relu")
    mine, theirs = attention_pairs(student, teacher)
    assert weight_taps("mse", mine, theirs) == (None, None)
    inline, _ = vitconvert.convert(teacher, "inline", attn_init="copy")
    with pytest.raises(VitconvertError, match="normalised kernel .*; the student's layer 0 is inline"):
        check_layers(attention_pairs(inline, teacher)[0], theirs)
    with pytest.raises(VitconvertError, match="timm's Attention; the teacher's layer 0 is Identity"):
        check_layers(mine, [torch.nn.Identity()] * 2)


def test_a_second_run_reads_the_teachers_weights_from_the_cache_and_gets_the_same_losses(monkeypatch):
    """The teacher-output cache keeps weight_ce's (B, H, N, N) softmax weights in place of the attention outputs: a
    second task on the same batches never runs the teacher, and its two SGD steps see the same losses, bit for
    bit (the same student path on the same teacher values)."""
    student, teacher = (m.float() for m in pair("hedgehog"))
    recipe = build_recipe({"attn_loss": "weight_ce", "kd_weight": 1.0})
    calls = counting_teacher(monkeypatch)
    torch.manual_seed(1)
    batches = [(torch.randn(2, 3, 32, 32), torch.randint(0, 3, (2,))) for _ in range(2)]
    cache = TeacherCache(capacity=1 << 20)

    def losses() -> list[tuple[float, float]]:
        task = DistillationTask(copy.deepcopy(student), teacher, recipe, torch.device("cpu"), None, False,
                                teacher_cache=cache)
        sgd = torch.optim.SGD(task.model.parameters(), lr=0.1)
        seen = []
        for slot, (images, targets) in enumerate(batches):
            got = task(images, targets, slot)
            got["loss"].backward()
            sgd.step()
            sgd.zero_grad()
            seen.append((got["loss"].item(), float(got["attn"])))
        task.close()
        return seen

    first = losses()
    assert calls[0] == 2 and all(2.0 < attn < 10.0 for _, attn in first)  # the weights' cross-entropy, ~ln 17
    second = losses()
    assert calls[0] == 2  # every batch's teacher weights and logits came from the cache
    assert second == first


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight-ce")
    make_teacher(root / "teacher")
    make_images(root / "images")
    return root


def test_distill_with_set_attn_loss_weight_ce(workspace, tmp_path, monkeypatch):
    """The user's path: `--set attn_loss=weight_ce` trains on the weights' cross-entropy (at least the teacher's
    row entropy, about ln 17 for a random teacher's near-uniform rows, where the outputs' MSE is far below 1);
    an InLine student is refused before anything is written (with --fsdp: tests/cli/bad_input_cases.py)."""
    monkeypatch.chdir(tmp_path)
    for variant in ("relu", "inline"):
        made = invoke("convert", workspace / "teacher", "--to", variant, "--out", variant)
        assert made.exit_code == 0, made.output
    ran = invoke("distill", "relu", "--data", workspace / "images", "--epochs", "1", *CLI_FAST,
                 "--set", "attn_loss=weight_ce", "--out", "run")
    assert ran.exit_code == 0, ran.output
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    attn = [s["attn"] for s in steps if "attn" in s]
    assert attn and all(2.0 < a < 10.0 for a in attn), attn
    refused = invoke("distill", "inline", "--data", workspace / "images", "--epochs", "1", *CLI_FAST,
                     "--set", "attn_loss=weight_ce", "--out", "refused")
    assert_one_line_error(refused, "--set attn_loss=weight_ce needs attention weights that are a normalised kernel")
    assert not (tmp_path / "refused").exists()
