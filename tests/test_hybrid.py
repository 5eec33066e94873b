"""Hybrid students: only the chosen attention layers go linear; the rest keep the teacher's softmax."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from helpers import assert_one_line_error, image_batch, invoke, tiny_model

import vitconvert
from vitconvert.errors import BadValue
from vitconvert.hybrid import choose_softmax_layers
from vitconvert.selection import describe, linear_layers
from vitconvert.sources import load_source


def deep(family: str = "vit"):
    return tiny_model(family, depth=4)


def kinds(model) -> list[str]:
    return [getattr(b.attn, "variant", "softmax") for b in model.blocks]


def test_keeping_every_layer_softmax_is_the_source_bitwise():
    teacher = deep()
    student, report = vitconvert.convert(teacher, "elu", keep_softmax="0-3")
    x = image_batch(teacher)
    assert report.surgery.layers == [] and kinds(student) == ["softmax"] * 4
    assert torch.equal(student(x), teacher(x))
    assert all(torch.equal(a, b) for a, b in zip(student.state_dict().values(), teacher.state_dict().values(),
                                                 strict=True))


@pytest.mark.parametrize("variant", list(vitconvert.VARIANTS))
def test_keeping_none_is_todays_full_conversion(variant):
    teacher = deep()
    full, _ = vitconvert.convert(teacher, variant, seed=3)
    none_kept, report = vitconvert.convert(teacher, variant, seed=3, keep_softmax=[])
    every, _ = vitconvert.convert(teacher, variant, seed=3, layers="0-3")
    x = image_batch(teacher)
    assert report.surgery.layers == [0, 1, 2, 3] and not report.surgery.hybrid
    assert torch.equal(none_kept(x), full(x)) and torch.equal(every(x), full(x))


def test_selection_by_index_list_range_and_complement():
    teacher = deep()
    by_layers, _ = vitconvert.convert(teacher, "mhla", layers="2-3", options={"blocks_per_side": 2})
    by_keep, report = vitconvert.convert(teacher, "mhla", keep_softmax=[0, 1], options={"blocks_per_side": 2})
    by_name, _ = vitconvert.convert(teacher, "mhla", keep_softmax="blocks.0,blocks.1.attn",
                                    options={"blocks_per_side": 2})
    assert kinds(by_layers) == kinds(by_keep) == kinds(by_name) == ["softmax", "softmax", "mhla", "mhla"]
    assert report.surgery.layers == [2, 3] and report.surgery.hybrid
    x = image_batch(teacher)
    assert torch.equal(by_layers(x), by_keep(x))
    assert torch.equal(by_keep.blocks[0].attn.qkv.weight, teacher.blocks[0].attn.qkv.weight)  # kept as it was
    assert linear_layers(12, "0,2-4,11") == [0, 2, 3, 4, 11] and describe([0, 2, 3, 4, 11], 12) == "0,2-4,11"


@pytest.mark.parametrize("spec,message", [("9", "does not exist"), ("x", "expects layer indices"),
                                          ("3-1", "runs backwards"), ("auto:1", "chosen from data")])
def test_bad_selections_are_refused(spec, message):
    with pytest.raises(BadValue, match=message):
        vitconvert.convert(deep(), "elu", keep_softmax=spec)


@pytest.mark.parametrize("variant", ["elu", "mhla"])
def test_a_hybrid_folder_round_trips_through_load_and_timm_bitwise(tmp_path, variant):
    teacher = deep("dinov2")
    options = {"blocks_per_side": 2} if variant == "mhla" else None
    student, _ = vitconvert.convert(teacher, variant, keep_softmax="1,3", options=options)
    folder = vitconvert.save(student, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_args"]["layers"] == [0, 2] and config["vitconvert"]["layers"] == [0, 2]
    x = image_batch(teacher)
    loaded = vitconvert.load(folder)
    from_timm = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    assert kinds(loaded) == kinds(from_timm) == [variant, "softmax", variant, "softmax"]
    assert torch.equal(loaded(x), student.eval()(x)) and torch.equal(from_timm(x), loaded(x))
    card = (folder / "README.md").read_text()
    assert "linear 0,2, softmax 1,3 (a hybrid of 4 layers)" in card


def test_shared_relative_position_bias_stays_while_a_softmax_layer_reads_it():
    teacher = tiny_model("beit", depth=2, use_shared_rel_pos_bias=True, use_rel_pos_bias=False)
    hybrid, _ = vitconvert.convert(teacher, "elu", keep_softmax="0")
    full, _ = vitconvert.convert(teacher, "elu")
    assert hybrid.rel_pos_bias is not None and full.rel_pos_bias is None
    assert torch.isfinite(hybrid(image_batch(teacher))).all()


@pytest.mark.parametrize("signal", ["attn-gap", "logit-kl"])
def test_auto_selection_is_deterministic_for_a_seed_and_leaves_the_teacher_as_it_was(signal):
    teacher = load_source("digits").model
    flags = [p.requires_grad for p in teacher.parameters()]
    first = choose_softmax_layers(teacher, "elu", 2, "digits", signal=signal, steps=5, batches=2, batch_size=16)
    again = choose_softmax_layers(teacher, "elu", 2, "digits", signal=signal, steps=5, batches=2, batch_size=16)
    assert first == again and len(first.keep) == 2 and len(first.scores) == 4
    ranked = sorted(range(4), key=lambda i: -first.scores[i])
    assert first.keep == sorted(ranked[:2])  # the two layers that lose most
    assert [p.requires_grad for p in teacher.parameters()] == flags


def test_auto_selection_scores_what_distillation_cannot_fix():
    """attn-gap after the short distillation is below the gap before it, layer by layer."""
    teacher = load_source("digits").model
    before = choose_softmax_layers(teacher, "relu", 1, "digits", signal="attn-gap", steps=0, batches=2, batch_size=16)
    after = choose_softmax_layers(teacher, "relu", 1, "digits", signal="attn-gap", steps=20, batches=2, batch_size=16)
    assert all(a < b for a, b in zip(after.scores, before.scores, strict=True))


def test_cli_auto_hybrid_then_distill_and_eval(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", "digits", "--to", "elu", "--keep-softmax", "auto:1", "--data", "digits", "--out", "s")
    assert result.exit_code == 0, result.output
    block = json.loads((tmp_path / "s" / "config.json").read_text())["vitconvert"]
    assert len(block["layers"]) == 3 and block["selection"]["signal"] == "logit-kl"
    assert block["selection"]["keep"] == [i for i in range(4) if i not in block["layers"]]
    result = invoke("distill", "s", "--recipe", "quickstart", "--data", "digits", "--epochs", "1", "--out", "r")
    assert result.exit_code == 0, result.output
    result = invoke("eval", "r", "--data", "digits", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["top1"] > 0.3
    info = invoke("info", "r")
    assert "softmax" in info.stdout and "hybrid of 4 layers" in info.stdout


def test_cli_refusals(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke("convert", "digits", "--to", "elu", "--keep-softmax", "auto:1"), "--data")
    assert_one_line_error(invoke("convert", "digits", "--to", "elu", "--layers", "99"), "--layers: layer 99")
    assert_one_line_error(invoke("convert", "digits", "--to", "elu", "--keep-softmax", "0-3"), "the source model")
    assert_one_line_error(invoke("convert", "digits", "--to", "elu", "--layers", "1", "--keep-softmax", "0"),
                          "not both")
    assert list(tmp_path.iterdir()) == []


def test_bench_times_hybrids_against_the_softmax_source():
    from vitconvert.bench import benchmark

    report = benchmark(deep(), ["elu"], [128], repeats=1, warmup=0, threads=1, memory=False, keep_softmax="0,1")
    assert report.keep_softmax == [0, 1]
    rows = {r.model: r for r in report.rows}
    assert set(rows) == {"softmax", "elu"} and rows["elu"].speedup > 0
    full = benchmark(deep(), ["elu"], [128], repeats=1, warmup=0, threads=1, memory=False)  # 257 tokens
    assert full.keep_softmax is None
    # half the layers softmax: the hybrid's FLOPs lie between the softmax model's and the full conversion's
    hybrid_flops = rows["elu"].gflops_per_img
    full_flops = {r.model: r for r in full.rows}["elu"].gflops_per_img
    assert min(full_flops, rows["softmax"].gflops_per_img) < hybrid_flops < max(full_flops,
                                                                                rows["softmax"].gflops_per_img)


def test_a_folder_whose_two_layer_records_disagree_is_refused(tmp_path):
    """ELU and softmax layers have the same weight shapes: a mismatch would otherwise load silently."""
    student, _ = vitconvert.convert(deep(), "elu", keep_softmax="0")
    folder = vitconvert.save(student, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["model_args"]["layers"] = [0, 1, 2]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(vitconvert.errors.VitconvertError, match="disagrees with itself"):
        vitconvert.load(folder)
