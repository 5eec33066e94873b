"""SOURCE strings through timm's loading: names, aliases, folders, weight files, the offline Hub cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import timm
import torch
from helpers import FAMILIES, place_in_hub_cache, tiny_model

from vitconvert.cli.common import for_cli
from vitconvert.errors import VitconvertError
from vitconvert.sources import SourceNotFound, load_source, resolve, resolve_alias


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def timm_folder(tmp_path):
    model = tiny_model("vit")
    timm.models.save_for_hf(model, str(tmp_path / "timm"), safe_serialization=True)
    return model, tmp_path / "timm"


def test_alias_and_name_without_pretrained():
    assert resolve_alias("deit_small") == "deit_small_patch16_224"
    src = load_source("deit_tiny", pretrained=False, img_size=32, patch_size=8, depth=1)
    assert src.arch == "deit_tiny_patch16_224" and not src.pretrained


def test_timm_folder_plain_and_local_dir(timm_folder):
    model, folder = timm_folder
    for spec in (str(folder), f"local-dir:{folder}"):
        src = load_source(spec)
        assert _same(src.model, model) and src.arch == "vit_tiny_patch16_224"


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_weights_file_with_arch(tmp_path, suffix):
    model = tiny_model("vit", num_classes=10)
    path = tmp_path / f"w{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(model.state_dict(), str(path))
    else:
        torch.save({"model": model.state_dict()}, path)
    _, kwargs = FAMILIES["vit"]
    src = load_source(str(path), arch="vit_tiny_patch16_224", **kwargs)
    assert _same(src.model, model) and src.model.num_classes == 10


def test_pickled_objects_are_never_unpickled(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pth"
    torch.save({"x": Evil()}, path)
    with pytest.raises(VitconvertError, match="is a pickle of more than tensors .*: vitconvert never unpickles a file"):
        load_source(str(path), arch="vit_tiny_patch16_224")


def test_weights_that_do_not_fit_arch(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file(tiny_model("vit").state_dict(), str(path))
    with pytest.raises(VitconvertError, match="do not fit"):
        load_source(str(path), arch="deit_small_patch16_224", img_size=32, patch_size=8)


def test_weights_file_needs_arch(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"x")
    with pytest.raises(VitconvertError, match="arch=NAME") as info:
        load_source(str(path))
    assert "--arch NAME" in for_cli(f"{info.value}")  # the command line names the flag


def test_corrupt_safetensors_in_folder(timm_folder):
    _, folder = timm_folder
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    with pytest.raises(VitconvertError, match="corrupt or truncated"):
        load_source(str(folder))


@pytest.mark.parametrize("spec,message", [
    ("deit_smal", "did you mean"),
    ("./no/such/folder", "path not found"),
    ("hf-hub:bad id!", "invalid Hub id"),
    ("", "empty"),
])
def test_bad_sources(spec, message):
    with pytest.raises(VitconvertError, match=message):
        load_source(spec, pretrained=False)


def test_folder_without_config(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(VitconvertError, match="no config.json"):
        load_source(str(tmp_path / "x"))


def test_pretrained_name_offline_gives_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(VitconvertError, match="pretrained=False"):
        load_source("deit_tiny", pretrained=True, depth=1)


def test_timm_repo_from_offline_hub_cache(timm_folder, tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    model, folder = timm_folder
    place_in_hub_cache(tmp_path / "cache", "timm/tiny_vit_test", folder)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    src = load_source("hf-hub:timm/tiny_vit_test")
    assert _same(src.model, model)


def test_digits_names_the_bundled_teacher():
    from vitconvert.assets import TEACHER_DIR

    src = load_source("digits")
    assert src.spec == "digits" and src.arch == "vit_tiny_patch16_224" and src.model.num_classes == 10
    assert _same(src.model, load_source(str(TEACHER_DIR)).model)


@pytest.mark.parametrize("value,offline", [("1", True), ("true", True), ("YES", True), ("on", True),
                                           ("off", False), ("0", False), ("", False), ("false", False)])
def test_hf_hub_offline_is_read_one_way_everywhere(monkeypatch, value, offline):
    """huggingface_hub's own true values decide, for the source resolver and for push alike ("off" is online)."""
    import huggingface_hub
    import huggingface_hub.constants as c
    from huggingface_hub.errors import LocalEntryNotFoundError

    from vitconvert.hub_io import hub_offline
    from vitconvert.hub_io import hub_snapshot as hub_folder

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert hub_offline() is offline

    def not_cached(*args, **kwargs):
        raise LocalEntryNotFoundError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_cached)
    with pytest.raises(VitconvertError) as info:
        hub_folder("me/not-cached")
    assert ("HF_HUB_OFFLINE is set" in str(info.value)) is offline


def test_hf_hub_offline_set_before_huggingface_hub_was_imported_counts(monkeypatch):
    import huggingface_hub.constants as c

    from vitconvert.hub_io import hub_offline

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)  # e.g. TRANSFORMERS_OFFLINE=1, which huggingface_hub also reads
    assert hub_offline()


def test_resolve_says_what_each_form_names(timm_folder, tmp_path, monkeypatch, hub_cache):
    from vitconvert.assets import TEACHER_DIR

    _, folder = timm_folder
    place_in_hub_cache(hub_cache, "me/tiny", folder, revision="v1")
    monkeypatch.setenv("HOME", str(tmp_path))
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x")
    hub = resolve("hf-hub:me/tiny@v1")
    assert (hub.kind, hub.repo_id, hub.revision) == ("folder", "me/tiny", "v1")
    assert (hub.path / "config.json").read_bytes() == (folder / "config.json").read_bytes() and not hub.linear
    for spec in (str(folder), f"local-dir:{folder}", "~/timm", "local-dir:~/timm"):
        assert (resolve(spec).kind, resolve(spec).path) == ("folder", folder), spec
    assert resolve(str(weights)).kind == "file" and resolve(str(weights)).path == weights
    digits = resolve("digits")
    assert (digits.kind, digits.path, digits.bundled) == ("folder", TEACHER_DIR, True)
    assert (resolve("deit_small").kind, resolve("deit_small").name) == ("timm", "deit_small_patch16_224")
    assert resolve("vit_tiny_patch16_224").name == "vit_tiny_patch16_224"


def test_a_bare_name_beats_a_folder_without_a_model_but_not_one_with(timm_folder, tmp_path, monkeypatch):
    _, folder = timm_folder
    monkeypatch.chdir(tmp_path)
    (tmp_path / "digits").mkdir()  # an image folder named after its data
    assert resolve("digits").bundled and resolve("./digits").path == Path("digits")
    shutil.copytree(folder, tmp_path / "deit_small")  # a model folder of that name: the folder it is
    assert resolve("deit_small").kind == "folder"


@pytest.mark.parametrize("spec,message", [
    ("", "empty model source"),
    ("./nope", "path not found: ./nope"),
    ("~/nope/model", "path not found: ~/nope/model"),
    ("local-dir:/no/such", "folder not found: /no/such"),
    ("no_such_model_name", "unknown model 'no_such_model_name'"),
])
def test_resolve_a_string_that_names_nothing(spec, message):
    with pytest.raises(SourceNotFound, match=message):
        resolve(spec)


def test_local_dir_names_a_folder(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"x")
    with pytest.raises(SourceNotFound, match="local-dir: names a folder"):
        resolve(f"local-dir:{tmp_path / 'w.safetensors'}")


def test_a_converted_model_as_source_names_its_recorded_source_not_only_the_architecture(tmp_path):
    # the digits student's architecture is vit_tiny_patch16_224: converting that name would take ImageNet weights
    import vitconvert

    student, _ = vitconvert.convert(load_source("digits").model, "elu", source="digits")
    vitconvert.save(student, tmp_path / "student")
    with pytest.raises(VitconvertError, match=r"converted from \(digits, a vit_tiny_patch16_224\)"):
        load_source(str(tmp_path / "student"))
