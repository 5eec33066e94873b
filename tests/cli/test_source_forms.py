"""Every SOURCE form through every command that names it in its help: a timm name, an alias, the bundled digits,
a folder by path, ``local-dir:``, ``~``, an ``hf-hub:`` repo from an offline Hub cache, a vitconvert folder and
a run folder — eval, export, bench, compare (student and --teacher), info, and ``vitconvert.load``.

The timm name is a tiny ViT registered with timm for this module (``tiny_resolver_vit``, 3 classes at 32 px), so
that a name builds in milliseconds and fits the 3-class image folder; one real timm name is loaded too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import timm
from distill.helpers import make_images
from helpers import assert_one_line_error, invoke, place_in_hub_cache
from timm.models import VisionTransformer, build_model_with_cfg, register_model

import vitconvert
from vitconvert.aliases import ALIASES
from vitconvert.attention import LinearAttention

NAME, ALIAS = "tiny_resolver_vit", "tiny_resolver"
pytestmark = pytest.mark.usefixtures("one_thread", "forms_env")


@register_model
def tiny_resolver_vit(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """A timm name for this module's tests: a 2-block ViT of width 32, 3 classes at 32 px."""
    args = dict(img_size=32, patch_size=8, embed_dim=32, num_heads=2, depth=2, num_classes=3)
    return build_model_with_cfg(VisionTransformer, NAME, pretrained, **{**args, **kwargs})


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """softmax/ (a timm folder of the named model), linear/ (converted from it), run/ (linear/ plus what a distill
    run writes beside it), name-linear/ and digits-linear/ (converted from the name with random weights, and from
    digits), images/, and home/cache: a Hub cache holding softmax/ as org/softmax and linear/ as org/linear."""
    root = tmp_path_factory.mktemp("forms")
    model = timm.create_model(NAME, pretrained=False)
    timm.models.save_for_hf(model, str(root / "softmax"), safe_serialization=True)
    student, _ = vitconvert.convert(model, "elu", source=str(root / "softmax"))
    vitconvert.save(student, root / "linear", pretrained=True)
    shutil.copytree(root / "linear", root / "run")
    (root / "run" / "recipe.yaml").write_text("epochs: 1\n")
    (root / "run" / "metrics.jsonl").write_text('{"epoch": 0, "top1": 50.0}\n')
    (root / "run" / "checkpoint-last").mkdir()
    ok(invoke("convert", NAME, "--to", "elu", "--no-pretrained", "--out", root / "name-linear"))
    digits, _ = vitconvert.convert(vitconvert.load("digits"), "elu", source="digits")
    vitconvert.save(digits, root / "digits-linear", pretrained=True)
    make_images(root / "images")
    for repo in ("softmax", "linear"):
        place_in_hub_cache(root / "home" / "cache", f"org/{repo}", root / repo)
    for name in ("softmax", "linear"):
        (root / "home" / name).symlink_to(root / name)
    return root


@pytest.fixture
def forms_env(ws, monkeypatch):
    """``~`` is ws/home, the Hub cache ws/home/cache (offline), the alias known."""
    import huggingface_hub.constants as c

    monkeypatch.setenv("HOME", str(ws / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(ws / "home" / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(ws / "home" / "cache"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setitem(ALIASES, ALIAS, NAME)


def spell(form: str, ws: Path) -> str:
    """The SOURCE string of a form (paths under ws)."""
    return {"name": NAME, "alias": ALIAS, "digits": "digits", "softmax folder": str(ws / "softmax"),
            "local-dir softmax": f"local-dir:{ws / 'softmax'}", "~ softmax": "~/softmax",
            "hf-hub softmax": "hf-hub:org/softmax", "linear folder": str(ws / "linear"), "run folder": str(ws / "run"),
            "local-dir linear": f"local-dir:{ws / 'linear'}", "~ linear": "~/linear",
            "hf-hub linear": "hf-hub:org/linear@main"}[form]


SOFTMAX = ["name", "alias", "digits", "softmax folder", "local-dir softmax", "~ softmax", "hf-hub softmax"]
LINEAR = ["linear folder", "run folder", "local-dir linear", "~ linear", "hf-hub linear"]


def data_for(form: str, ws: Path) -> str:
    return "digits" if form == "digits" else str(ws / "images")


def ok(result) -> str:
    assert result.exit_code == 0, result.output + result.stderr
    return result.stdout


@pytest.mark.parametrize("form", SOFTMAX + LINEAR)
def test_load(form, ws):
    model = vitconvert.load(spell(form, ws), pretrained=False)
    linear = any(isinstance(m, LinearAttention) for m in model.modules())
    assert linear == (form in LINEAR)
    assert model.num_classes == (10 if form == "digits" else 3)


def test_load_a_real_timm_name():
    model = vitconvert.load("vit_tiny_patch16_224", pretrained=False)
    assert type(model).__name__ == "VisionTransformer" and model.num_classes == 1000


@pytest.mark.parametrize("form", SOFTMAX + LINEAR)
def test_eval(form, ws):
    out = ok(invoke("eval", spell(form, ws), "--data", data_for(form, ws), "--no-pretrained", "--json"))
    assert json.loads(out)["n"] == (297 if form == "digits" else 6)


@pytest.mark.parametrize("form", SOFTMAX + LINEAR)
def test_export(form, ws, tmp_path):
    target = tmp_path / "m.pt2"
    out = ok(invoke("export", spell(form, ws), "--format", "pt2", "--fixed-batch", "--batch-size", "1",
                    "--no-pretrained", "--out", target, "--json"))
    assert json.loads(out)["path"] == str(target) and target.stat().st_size > 0


@pytest.mark.parametrize("form,written", [("digits", "digits.pt2"), ("name", f"{NAME}.pt2"),
                                          ("hf-hub linear", "linear.pt2"), ("local-dir linear", "models/linear.pt2")])
def test_export_writes_beside_a_local_folder_else_here(form, written, ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = spell(form, ws)
    if form == "local-dir linear":  # a copy: the default output goes beside it, not into the shared workspace
        shutil.copytree(ws / "linear", tmp_path / "models" / "linear")
        source = "local-dir:models/linear"
    out = ok(invoke("export", source, "--format", "pt2", "--fixed-batch", "--batch-size", "1", "--no-pretrained",
                    "--json"))
    assert Path(json.loads(out)["path"]).resolve() == (Path.cwd() / written).resolve()


@pytest.mark.parametrize("form", SOFTMAX + LINEAR)
def test_bench(form, ws):
    report = json.loads(ok(invoke("bench", spell(form, ws), "--to", "elu", "--repeats", "1", "--warmup", "0",
                                  "--no-memory", "--no-pretrained", "--json")))
    assert {row["model"] for row in report["results"]} == {"softmax", "elu"}


@pytest.mark.parametrize("form", LINEAR)
def test_compare_student(form, ws):
    report = json.loads(ok(invoke("compare", spell(form, ws), "--data", ws / "images", "--batches", "1",
                                  "--batch-size", "2", "--json")))
    assert report["teacher"] == str(ws / "softmax") and len(report["layers"]) == 2


@pytest.mark.parametrize("form", ["name", "alias", "digits", "softmax folder", "local-dir softmax", "~ softmax",
                                  "hf-hub softmax"])
def test_compare_teacher(form, ws):
    """A named teacher is built as the student's source was: a name with random weights for name-linear/."""
    student = ws / {"name": "name-linear", "alias": "name-linear", "digits": "digits-linear"}.get(form, "linear")
    report = json.loads(ok(invoke("compare", student, "--teacher", spell(form, ws), "--data", data_for(form, ws),
                                  "--batches", "1", "--batch-size", "2", "--json")))
    assert report["teacher"] == spell(form, ws) and report["images"] == 2


def test_compare_rebuilds_a_teacher_recorded_by_its_timm_name(ws):
    """A student converted from a timm name with random weights: its teacher is that name, rebuilt from the seed."""
    report = json.loads(ok(invoke("compare", ws / "name-linear", "--data", ws / "images", "--batches", "1",
                                  "--batch-size", "2", "--json")))
    assert report["teacher"] == NAME and len(report["layers"]) == 2


@pytest.mark.parametrize("form", LINEAR)
def test_info(form, ws):
    info = json.loads(ok(invoke("info", spell(form, ws), "--json")))
    assert info["variant"] == "elu" and info["architecture"] == NAME


@pytest.mark.parametrize("form", ["name", "digits", "softmax folder", "hf-hub softmax"])
def test_commands_that_take_vitconvert_folders_say_so(form, ws):
    for command in (("info",), ("compare", "--data", str(ws / "images"))):
        assert_one_line_error(invoke(command[0], spell(form, ws), *command[1:]), "is not a vitconvert model folder")


@pytest.mark.parametrize("args,message", [
    (("eval", "no_such_model", "--data", "digits"), "unknown model 'no_such_model'"),
    (("export", "./no/such/folder"), "path not found: ./no/such/folder"),
    (("bench", "local-dir:/no/such/folder"), "folder not found: /no/such/folder"),
    (("compare", "nope", "--data", "digits"), "student folder not found: nope (give a vitconvert model or run folder"),
    (("info", "nope"), "model folder not found: nope (give a vitconvert model or run folder"),
    (("eval", "hf-hub:org/not-cached", "--data", "digits"), "not in the Hub cache"),
])
def test_a_string_that_names_nothing_is_one_line(args, message):
    assert_one_line_error(invoke(*args), message)


def test_files_are_refused_with_what_the_command_takes(ws, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    assert_one_line_error(invoke("export", text), "notes.txt is a file, not a model: give a vitconvert model")
    assert_one_line_error(invoke("bench", ws / "linear" / "model.safetensors"), "bare weights file")
    # a weights file beside a config.json is read as that folder says (convert DIR/model.safetensors): here a student
    assert_one_line_error(invoke("compare", ws / "linear", "--teacher", ws / "linear" / "model.safetensors",
                                 "--data", ws / "images"), "is a linear-attention vitconvert model; give a softmax ViT")


def test_a_bare_name_beats_a_same_named_folder_without_a_model(ws, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "digits").mkdir()  # e.g. an image folder named after the data
    (tmp_path / NAME).mkdir()
    assert json.loads(ok(invoke("eval", "digits", "--data", "digits", "--json")))["n"] == 297
    assert vitconvert.load(NAME, pretrained=False).num_classes == 3
    assert_one_line_error(invoke("eval", "./digits", "--data", "digits"), "has no config.json")


@pytest.mark.parametrize("command", ["compare", "distill"])
def test_a_named_teacher_takes_no_pretrained_where_its_weights_are_missing(command, ws, tmp_path):
    """linear/ records a pretrained source, so a named teacher is asked for pretrained weights; where there are
    none the error points to --no-pretrained, which both commands that take --teacher have (it was a dead end)."""
    if command == "compare":
        args = ["compare", ws / "linear", "--teacher", NAME, "--data", ws / "images", "--batches", "1",
                "--batch-size", "2", "--json"]
    else:
        args = ["distill", ws / "linear", "--teacher", NAME, "--data", ws / "images", "--epochs", "1",
                "--batch-size", "2", "--set", "compare_batches=0", "--out", tmp_path / "run", "--json"]
    refused = invoke(*args)
    assert_one_line_error(refused, "--no-pretrained")
    assert not (tmp_path / "run").exists()
    report = json.loads(ok(invoke(*args, "--no-pretrained")))
    if command == "distill":  # the run records its teacher in its folder's config.json
        report = json.loads((tmp_path / "run" / "config.json").read_text())["vitconvert"]
    assert report["teacher"] == NAME
