"""The end of a run compares the final student with its teacher: compare.json, compare.png, the card's table."""

from __future__ import annotations

import json

from vitconvert.distill import DistillJob, run
from vitconvert.recipes import load_recipe

from .helpers import FAST


def job(student, out, data, **extra):
    recipe, text = load_recipe(None, {**FAST, "data": str(data), **extra})
    return DistillJob(student=str(student), recipe=recipe, out=out, recipe_text=text, show=False)


def test_the_run_folder_and_the_card_show_the_per_layer_gaps(student, images, tmp_path, monkeypatch):
    import vitconvert.distill.final_compare as final_compare

    titles, draw = [], final_compare.compare_figure
    monkeypatch.setattr(final_compare, "compare_figure", lambda report, title: titles.append(title) or draw(report,
                                                                                                           title))
    folder = run(job(student, tmp_path / "run", images, compare_batches=2)).folder
    assert titles == ["run vs teacher (local)"]  # push sends the figure: the teacher by its name, not its path
    saved = json.loads((folder / "compare.json").read_text())
    assert [row["layer"] for row in saved["layers"]] == [0, 1]
    assert saved["images"] == 6 and 0 <= saved["top1_agreement"] <= 1 and saved["logit_kl"] >= 0  # 6 val images
    assert saved["teacher"].endswith("teacher") and saved["split"] == "validation"
    assert (folder / "compare.png").read_bytes().startswith(b"\x89PNG")
    config = json.loads((folder / "config.json").read_text())["vitconvert"]
    assert config["compare"]["layers"] == saved["layers"]
    card = (folder / "README.md").read_text()
    table = card.split("## Per-layer comparison with the teacher")[1].split("##")[0]
    assert "| layer |" in table and "attn_mse" in table and "top1 agreement" in table
    assert len([line for line in table.splitlines() if line.startswith("| 1 |")]) == 1
    assert not (folder / "best" / "compare.json").exists()  # best/ is written mid-run, without it


def test_compare_batches_0_skips_it_and_a_failure_keeps_the_model(student, images, tmp_path, monkeypatch, capsys):
    folder = run(job(student, tmp_path / "off", images, compare_batches=0)).folder
    assert not (folder / "compare.json").exists() and "Per-layer" not in (folder / "README.md").read_text()

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr("vitconvert.distill.final_compare.compare_models", broken)
    recipe, text = load_recipe(None, {**FAST, "data": str(images)})
    folder = run(DistillJob(str(student), recipe, tmp_path / "broken", text, show=True)).folder
    assert (folder / "model.safetensors").is_file() and not (folder / "compare.json").exists()
    assert "end-of-run comparison with the teacher failed (RuntimeError: out of memory)" in capsys.readouterr().err
