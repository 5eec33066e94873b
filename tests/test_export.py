"""`vitconvert export`: ONNX (read back by ONNX Runtime) and .pt2 reproduce vitconvert.load's logits."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import onnxruntime as ort
import pytest
import timm
import torch
from helpers import runner

import vitconvert
from vitconvert.attention import VARIANTS
from vitconvert.cli import app
from vitconvert.errors import VitconvertError
from vitconvert.export import export
from vitconvert.output_rules import check_file, written_file


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Every variant, one block: each block is the same module, so one reaches every path the exporters take
    (an export costs about its depth; the hybrid below has a softmax block beside a linear one)."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    softmax = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                                depth=1, num_heads=2, num_classes=5)
    return {v: vitconvert.save(vitconvert.convert(softmax, v)[0], root / v) for v in VARIANTS}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """An inline hybrid with local residual and class names (block 0 softmax, block 1 linear), exported by the
    command to ONNX and to .pt2: the folder, and each format's (result, file)."""
    root = tmp_path_factory.mktemp("hybrid")
    torch.manual_seed(0)
    softmax = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                                depth=2, num_heads=2, num_classes=3)
    softmax.pretrained_cfg = {**softmax.pretrained_cfg, "num_classes": 3, "label_names": ["cat", "dog", "fox"]}
    folder = vitconvert.save(vitconvert.convert(softmax, "inline", options={"local_residual": True}, layers=[1])[0],
                             root / "hybrid")
    exports = {}
    for fmt in ("onnx", "pt2"):
        out = root / f"m.{fmt}"
        exports[fmt] = runner.invoke(app, ["export", str(folder), "--format", fmt, "--out", str(out)]), out
    return folder, exports


def assert_onnx_runtime_reproduces_the_logits(onnx_file, folder) -> None:
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    x = torch.randn(5, 3, 32, 32)  # a batch size the export never saw
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = vitconvert.load(folder).eval()(x).numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"relu"}))  # relu: the command's own export, below
def test_onnx_runtime_reproduces_the_logits(folders, variant, tmp_path):
    result = export(folders[variant], "onnx", tmp_path / "m.onnx", dynamic_batch=True)
    assert result.rel_error <= 1e-4 and result.checked_batches == [2, 3]
    assert_onnx_runtime_reproduces_the_logits(tmp_path / "m.onnx", folders[variant])


def test_pt2_reproduces_the_logits_and_a_new_image_size_works(folders, tmp_path):
    result = export(folders["mhla"], "pt2", tmp_path / "m.pt2", img_size=48)
    assert result.img_size == 48 and result.rel_error <= 1e-4
    program = torch.export.load(str(tmp_path / "m.pt2"))
    model = vitconvert.load(folders["mhla"]).eval()
    model.set_input_size(img_size=48)
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        assert torch.allclose(program.module()(x), model(x), rtol=0, atol=1e-5)


def test_cli_writes_beside_the_folder_and_never_overwrites_without_force(folders):
    folder = folders["relu"]
    before = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    first = runner.invoke(app, ["export", str(folder)])
    assert first.exit_code == 0 and "relative error" in first.stdout, first.output
    target = folder.parent / "relu.onnx"
    assert target.is_file() and hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest() == before
    # relu's ONNX file as test_onnx_runtime_reproduces_the_logits checks the others': dynamic batch by default
    said = " ".join(first.stdout.split())
    assert "any batch" in said and "(batch 2 and 3): relative error" in said, said
    assert float(re.search(r"relative error ([0-9.e+-]+)", said)[1]) <= 1e-4, said
    assert_onnx_runtime_reproduces_the_logits(target, folder)
    again = runner.invoke(app, ["export", str(folder)])
    assert again.exit_code != 0 and again.stderr.strip() == f"error: {target} already exists; use --force to " \
                                                             "overwrite it"
    # --force may replace it: the ONNX file carries vitconvert's mark, the one check of --force that depends on the
    # format (the command replacing its own export with --force: tests/cli/test_outputs.py, on a .pt2)
    assert written_file(target) and check_file(target, force=True, suffix=".onnx") == target


@pytest.mark.parametrize("args, text", [
    (["--format", "tflite"], "error: --format: unknown format 'tflite'; choose from onnx, pt2"),
    (["--opset", "12"], "error: --opset: 12 is not supported"),
    (["--format", "pt2", "--opset", "18"], "error: --opset: applies to ONNX only, not to --format pt2"),
    (["--batch-size", "0"], "error: --batch-size: must be at least 1 (got 0)"),
    (["--img-size", "0"], "error: --img-size: must be at least 1 (got 0)"),
    (["--img-size", "4"], "error: --img-size: 4 px is smaller than one patch of "),  # it was an internal error
])
def test_bad_input_is_one_line_and_writes_nothing(folders, tmp_path, args, text):
    result = runner.invoke(app, ["export", str(folders["elu"]), "--out", str(tmp_path / "x.onnx"), *args])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code != 0 and len(lines) == 1 and text in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_output_may_not_be_the_input_folder(folders):
    result = runner.invoke(app, ["export", str(folders["elu"]), "--out", str(folders["elu"]), "--force"])
    assert result.exit_code != 0 and "is a folder" in result.stderr


def test_missing_onnx_packages_name_the_extra(folders, tmp_path, monkeypatch):
    import vitconvert.export as module

    monkeypatch.setattr(module, "_importable", lambda name: name != "onnxruntime")
    with pytest.raises(VitconvertError, match=r"needs onnxruntime: pip install 'vitconvert\[export\]'"):
        export(folders["elu"], "onnx", tmp_path / "m.onnx")


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_the_exported_file_says_what_it_is(hybrid, fmt):
    """Variant, its options, linear layers, class names and preprocessing travel in the file (ONNX metadata_props,
    .pt2 extra files), read back with onnx and torch.export.load and compared with the folder's config.json and
    timm."""
    import json

    folder, exports = hybrid
    result, path = exports[fmt]
    assert result.exit_code == 0, result.output
    keys = ["variant", "options", "linear_layers", "depth", "num_classes", "class_names", "preprocessing"]
    if fmt == "onnx":
        import onnx

        props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    else:
        props = {f"vitconvert_{k}": "" for k in keys}
        torch.export.load(str(path), extra_files=props)
    config = json.loads((folder / "config.json").read_text())
    block = config["vitconvert"]
    assert props["vitconvert_variant"] == block["variant"] == "inline"
    assert json.loads(props["vitconvert_options"]) == block["options"] and block["options"]["local_residual"] is True
    assert json.loads(props["vitconvert_linear_layers"]) == block["layers"] == [1]
    assert props["vitconvert_depth"] == "2" and props["vitconvert_num_classes"] == "3"
    assert json.loads(props["vitconvert_class_names"]) == config["pretrained_cfg"]["label_names"]
    want = timm.data.resolve_data_config({}, model=vitconvert.load(folder))
    got = json.loads(props["vitconvert_preprocessing"])
    assert got.keys() == want.keys() and all(got[k] == (list(v) if isinstance(v, tuple) else v)
                                             for k, v in want.items())


def test_a_batch_past_the_old_4096_bound_exports_and_checks(folders, tmp_path):
    """`export --batch-size 5000` failed once dynamic batch became the default: the trace took 5000 images and the
    batch dimension stopped at 4096. Traced at 2, checked at the asked batch and one more."""
    out = tmp_path / "m.pt2"
    result = runner.invoke(app, ["export", str(folders["relu"]), "--format", "pt2", "--batch-size", "4097",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "batch 4097 and 4098" in result.stdout and out.is_file()


def test_an_inline_hybrid_with_local_residual_exports_to_onnx(hybrid):
    """Its per-image conv had groups = batch × channels, which ONNX cannot take with a dynamic batch."""
    folder, exports = hybrid
    result, out = exports["onnx"]
    assert result.exit_code == 0, result.output
    assert_onnx_runtime_reproduces_the_logits(out, folder)
