"""push_folder through a monkeypatched HfApi (the network is never reached), and loading back from the Hub cache."""

from __future__ import annotations

import importlib
import json
import logging
import re
from pathlib import Path

import huggingface_hub
import pytest
import timm
import torch
from helpers import FAKE_TOKEN, FakeHub, image_batch, place_in_hub_cache, tiny_model
from huggingface_hub import HfApi, ModelCard

import vitconvert
from vitconvert.card import CARD_MARKER
from vitconvert.errors import VitconvertError
from vitconvert.folder import read_config
from vitconvert.hub import NEVER, push_folder, refresh_card


def test_dry_run_lists_model_and_run_files_only(tmp_path, online, no_network, make_folder):
    folder = make_folder(tmp_path / "run", run=True)
    plan = push_folder(folder, "me/x", dry_run=True)
    sizes = dict(plan.files)
    assert sorted(sizes) == ["README.md", "config.json", "curves.png", "metrics.jsonl", "model.safetensors",
                             "recipe.yaml"]
    assert all(sizes[name] == (folder / name).stat().st_size for name in sizes if name != "README.md")  # the card:
    # the refreshed one's size (test_dry_run_changes_nothing_in_the_folder)
    assert plan.skipped == ["best/", "checkpoint-last/", "events.out.tfevents.1", "optimizer.pt"]
    assert plan.dry_run and plan.commit_url is None and plan.card == "refreshed"


def test_dry_run_changes_nothing_in_the_folder(tmp_path, online, no_network, make_folder):
    """It rewrote README.md; it only says what a push would send (the refreshed card's size included)."""
    folder = make_folder(tmp_path / "run", run=True)
    (folder / "README.md").write_text(f"{CARD_MARKER}\nan old card\n")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()}
    plan = push_folder(folder, "me/x", dry_run=True)
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()} == before
    size = dict(plan.files)["README.md"]
    assert plan.card == "refreshed" and size == len(refresh_card(folder, read_config(folder), "me/x")[1].encode())
    (folder / "README.md").unlink()  # no card yet: the push would write one
    assert dict(push_folder(folder, "me/x", dry_run=True).files)["README.md"] == size
    assert not (folder / "README.md").exists()


def test_push_refreshes_card_atomically_with_repo_and_recipe(tmp_path, monkeypatch, online, make_folder):
    folder = make_folder(tmp_path / "run", run=True)
    FakeHub(monkeypatch)
    push_folder(folder, "me/x", token=FAKE_TOKEN)
    text = (folder / "README.md").read_text()
    assert 'vitconvert.load("hf-hub:me/x")' in text and "## Training recipe" in text
    assert ModelCard(text).data.datasets == ["uoft-cs/cifar10"]  # from the run's recipe.yaml
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_hand_written_card_is_kept_but_must_parse(tmp_path, online, no_network, make_folder):
    folder = make_folder(tmp_path / "m")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# my notes\n")
    assert push_folder(folder, "me/x", dry_run=True).card == "kept"
    assert (folder / "README.md").read_text().endswith("# my notes\n")
    (folder / "README.md").write_text("---\nlicense: [mit\n---\n# broken\n")
    with pytest.raises(VitconvertError, match="metadata does not parse"):
        push_folder(folder, "me/x", dry_run=True)


def test_push_arguments_reach_huggingface_hub(tmp_path, monkeypatch, online, make_folder):
    folder = make_folder(tmp_path / "run", run=True)
    hub = FakeHub(monkeypatch)
    plan = push_folder(folder, "me/x", private=True, revision="exp1", commit_message="first", token=FAKE_TOKEN)
    assert [n for n, _, _ in hub.calls] == ["create_repo", "create_branch", "upload_folder"]
    create = hub.kwargs("create_repo")
    assert hub.calls[0][1] == ("me/x",) and create["exist_ok"] is True and create["private"] is True
    assert create["token"] == FAKE_TOKEN and create["repo_type"] == "model"
    assert hub.kwargs("create_branch") == {"branch": "exp1", "token": FAKE_TOKEN, "repo_type": "model",
                                           "exist_ok": True}
    upload = hub.kwargs("upload_folder")
    assert upload["repo_id"] == "me/x" and Path(upload["folder_path"]) == folder
    assert upload["revision"] == "exp1" and upload["commit_message"] == "first" and upload["token"] == FAKE_TOKEN
    assert sorted(upload["allow_patterns"]) == sorted(name for name, _ in plan.files)
    assert upload["ignore_patterns"] == NEVER and "checkpoint-*" in NEVER and upload["delete_patterns"] == ["*"]
    assert plan.commit_url.endswith("/commit/abc")


def test_push_to_main_needs_no_branch_and_has_a_default_message(tmp_path, monkeypatch, online, make_folder):
    hub = FakeHub(monkeypatch)
    push_folder(make_folder(tmp_path / "m"), "me/x", token=FAKE_TOKEN)
    assert [n for n, _, _ in hub.calls] == ["create_repo", "upload_folder"]
    upload = hub.kwargs("upload_folder")
    assert upload["revision"] is None and hub.kwargs("create_repo")["private"] is False
    assert upload["commit_message"].startswith("Upload vit_tiny_patch16_224 with elu attention")
    assert sorted(upload["allow_patterns"]) == ["README.md", "config.json", "model.safetensors"]


def test_token_from_env_then_cached_login(tmp_path, monkeypatch, online, make_folder):
    folder = make_folder(tmp_path / "m")
    hub = FakeHub(monkeypatch)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_cached")
    push_folder(folder, "me/x")
    assert hub.kwargs("create_repo")["token"] == "hf_cached"
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    hub.calls.clear()
    push_folder(folder, "me/x")
    assert hub.kwargs("create_repo")["token"] == "hf_env"
    hub.calls.clear()
    push_folder(folder, "me/x", token="hf_flag")
    assert hub.kwargs("upload_folder")["token"] == "hf_flag"


def test_missing_token_says_how_to_log_in(tmp_path, monkeypatch, online, make_folder):
    hub = FakeHub(monkeypatch)
    with pytest.raises(VitconvertError, match="hf auth login") as info:
        push_folder(make_folder(tmp_path / "m"), "me/x")
    assert "HF_TOKEN" in str(info.value) and hub.calls == []


def http_library():
    """The HTTP library this huggingface_hub talks through: requests before 1.0, httpx in 1.x, httpx2 in 2.x (the
    floor is 0.25, CI runs the newest), so the errors below are the ones it raises."""
    major = int(huggingface_hub.__version__.split(".", 1)[0])  # not get_session(): it caches an online session
    return importlib.import_module({0: "requests", 1: "httpx"}.get(major, "httpx2"))


def http_response(code: int, url: str = "https://huggingface.co/api/repos/create"):
    http = http_library()
    if http.__name__ != "requests":
        return http.Response(code, request=http.Request("POST", url))
    response = http.Response()
    response.status_code, response.url, response.request = code, url, http.Request("POST", url).prepare()
    return response


def connect_error(message: str) -> Exception:
    http = http_library()
    return http.ConnectionError(message) if http.__name__ == "requests" else http.ConnectError(message)


def test_token_is_never_written_or_logged(tmp_path, monkeypatch, online, caplog, make_folder):
    from huggingface_hub.errors import HfHubHTTPError

    folder = make_folder(tmp_path / "run", run=True)
    caplog.set_level(logging.DEBUG)
    FakeHub(monkeypatch)
    push_folder(folder, "me/x", token=FAKE_TOKEN)
    echo = HfHubHTTPError(f"400 Bad Request: token {FAKE_TOKEN} is malformed",
                          response=http_response(400, "https://huggingface.co"))
    FakeHub(monkeypatch, fail={"upload_folder": echo})
    with pytest.raises(VitconvertError) as info:
        push_folder(folder, "me/x", token=FAKE_TOKEN)
    assert FAKE_TOKEN not in str(info.value) and "***" in str(info.value)
    assert FAKE_TOKEN not in caplog.text
    for f in tmp_path.rglob("*"):
        assert not f.is_file() or FAKE_TOKEN.encode() not in f.read_bytes(), f


def hub_errors():
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

    response = http_response
    return [
        (connect_error("[Errno -3] Temporary failure in name resolution"), "cannot reach the Hugging Face Hub"),
        (ConnectionError("connection reset"), "cannot reach the Hugging Face Hub"),
        (TimeoutError("timed out"), "cannot reach the Hugging Face Hub"),
        (OfflineModeIsEnabled("offline"), "cannot reach the Hugging Face Hub"),
        (HfHubHTTPError("401 Unauthorized", response=response(401)), "refused the token"),
        (HfHubHTTPError("403 Forbidden", response=response(403)), "write access"),
        (HfHubHTTPError("500 Server Error", response=response(500)), "500"),
        (RepositoryNotFoundError("404 not found", response=response(404)), "does not exist or your token"),
    ]


@pytest.mark.parametrize("stage", ["create_repo", "upload_folder"])
@pytest.mark.parametrize("error,text", hub_errors(), ids=lambda v: type(v).__name__ if isinstance(v, Exception)
                         else None)
def test_hub_failures_are_one_line(tmp_path, monkeypatch, online, stage, error, text, make_folder):
    FakeHub(monkeypatch, fail={stage: error})
    with pytest.raises(VitconvertError, match=text) as info:
        push_folder(make_folder(tmp_path / "m"), "me/x", token=FAKE_TOKEN)
    message = str(info.value)
    assert "\n" not in message
    if "token" not in text:
        assert "nothing was committed" in message


def test_offline_push_refuses_before_any_call(tmp_path, monkeypatch, make_folder):
    hub = FakeHub(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(VitconvertError, match="HF_HUB_OFFLINE is set"):
        push_folder(make_folder(tmp_path / "m"), "me/x", token=FAKE_TOKEN)
    assert hub.calls == []


@pytest.mark.parametrize("repo,text", [
    ("noslash", "expected org/name"), ("a/b/c", "expected org/name"), ("bad id/x", "expected org/name"),
    ("", "expected org/name"), ("me/x@dev", "the branch with revision, not @"), ("me/--x", "expected org/name"),
])
def test_invalid_repo_ids(tmp_path, repo, text):
    with pytest.raises(VitconvertError, match=text):
        push_folder(tmp_path, repo, dry_run=True)


def test_hf_hub_prefix_is_tolerated(tmp_path, online, no_network, make_folder):
    assert push_folder(make_folder(tmp_path / "m"), "hf-hub:me/x", dry_run=True).repo_id == "me/x"


def test_folders_that_cannot_be_pushed(tmp_path, online, no_network, make_folder):
    with pytest.raises(VitconvertError, match="folder not found"):
        push_folder(tmp_path / "missing", "me/x", dry_run=True)
    timm.models.save_for_hf(tiny_model("vit"), str(tmp_path / "plain"), safe_serialization=True)
    with pytest.raises(VitconvertError, match="not a vitconvert folder"):
        push_folder(tmp_path / "plain", "me/x", dry_run=True)
    folder = make_folder(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(VitconvertError, match="has no model.safetensors"):
        push_folder(folder, "me/x", dry_run=True)
    folder = make_folder(tmp_path / "t")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    with pytest.raises(VitconvertError, match="corrupt or truncated"):
        push_folder(folder, "me/x", dry_run=True)


# -- loading back by id, offline from the Hub cache ----------------------------------------------------------


def test_pushed_folder_loads_back_by_id_bit_exact(tmp_path, hub_cache, no_network, make_folder, monkeypatch):
    """The issue's "done when": the dry-run's folder, laid out as the Hub cache, loads by hf-hub:me/x offline."""
    from PIL import Image

    folder = make_folder(tmp_path / "m", variant="mhla")
    refresh_card(folder, read_config(folder), "me/x")  # the card a push writes before it uploads
    place_in_hub_cache(hub_cache, "me/x", folder)
    place_in_hub_cache(hub_cache, "me/x", folder, revision="v1")
    original = vitconvert.load(folder)
    snippet = (folder / "README.md").read_text().split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (48, 40), (200, 30, 90)).save("image.jpg")  # the image the snippet opens
    scope: dict = {}
    exec(snippet, scope)  # the card's snippet, as a reader would run it
    for model in (scope["model"], vitconvert.load("hf-hub:me/x@v1")):
        a, b = original.state_dict(), model.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        x = image_batch(original)
        assert torch.equal(original(x), model(x))


def test_timm_repo_loads_from_cache_bit_exact(tmp_path, hub_cache):
    source = tiny_model("vit")
    timm.models.save_for_hf(source, str(tmp_path / "src"), safe_serialization=True)
    place_in_hub_cache(hub_cache, "timm/tiny_vit", tmp_path / "src")
    loaded = vitconvert.load("hf-hub:timm/tiny_vit")
    a, b = source.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_revision_offline_is_one_clear_line(tmp_path, hub_cache, make_folder):
    place_in_hub_cache(hub_cache, "me/x", make_folder(tmp_path / "m"))
    with pytest.raises(VitconvertError) as info:
        vitconvert.load("hf-hub:me/x@nope")
    assert re.fullmatch(r"me/x@nope is not in the Hub cache and HF_HUB_OFFLINE is set \(cached revisions: main\); "
                        r"unset HF_HUB_OFFLINE to download it", str(info.value))
    with pytest.raises(VitconvertError, match="nothing of this repo is cached"):
        vitconvert.load("hf-hub:me/other")


def test_card_marker_is_in_every_saved_folder(tmp_path, make_folder):
    folder = make_folder(tmp_path / "m")
    assert CARD_MARKER in (folder / "README.md").read_text()
    assert json.loads((folder / "config.json").read_text())["vitconvert"]["variant"] == "elu"


class LocalRepo:
    """A Hub repo kept in a dict ({path: bytes}): huggingface_hub's own upload_folder runs against it (its
    listing of remote files, its delete_patterns and its operations), only the HTTP calls are replaced."""

    def __init__(self, monkeypatch, files: dict[str, bytes]):
        import huggingface_hub.hf_api as hf_api

        self.files = dict(files)
        monkeypatch.setattr(hf_api, "is_xet_available", lambda: False)  # the single-commit path, no Xet transfer
        monkeypatch.setattr(HfApi, "create_repo", lambda api, *a, **kw: None)
        monkeypatch.setattr(HfApi, "create_branch", lambda api, *a, **kw: None)
        monkeypatch.setattr(HfApi, "list_repo_files", lambda api, *a, **kw: sorted(self.files))
        monkeypatch.setattr(HfApi, "create_commit", self.commit)
        monkeypatch.setattr(HfApi, "_validate_yaml", lambda api, content, **kw: ModelCard(content))  # the Hub's check

    def commit(self, *, operations, **kwargs):
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        for op in operations:
            if isinstance(op, CommitOperationDelete):
                del self.files[op.path_in_repo]
            else:
                assert isinstance(op, CommitOperationAdd)
                self.files[op.path_in_repo] = Path(op.path_or_fileobj).read_bytes()
        return type("CommitInfo", (), {"commit_url": "https://huggingface.co/me/x/commit/def"})()


def test_a_push_to_an_existing_repo_leaves_only_the_new_folders_files(tmp_path, monkeypatch, online, make_folder):
    """A repo an earlier push filled (a run folder: recipe, metrics, curves; a file since renamed) holds after
    pushing a plain model folder that folder's files only; .gitattributes, which the Hub needs, stays."""
    repo = LocalRepo(monkeypatch, {".gitattributes": b"*.safetensors filter=lfs\n", "config.json": b"{}",
                                   "model.safetensors": b"old", "README.md": b"old", "recipe.yaml": b"epochs: 2\n",
                                   "metrics.jsonl": b"{}\n", "curves.png": b"png", "notes/old.txt": b"x"})
    folder = make_folder(tmp_path / "m")
    plan = push_folder(folder, "me/x", token=FAKE_TOKEN)
    assert sorted(repo.files) == [".gitattributes", "README.md", "config.json", "model.safetensors"]
    assert all(repo.files[name] == (folder / name).read_bytes() for name, _ in plan.files)
    assert plan.commit_url.endswith("/commit/def")


def test_a_local_source_reaches_the_hub_by_its_name_only(tmp_path, monkeypatch, online):
    """config.json records a local source as an absolute path (compare and distill need it); the card, config.json
    and recipe.yaml the Hub gets name it only (`src (local)`), through huggingface_hub's own upload_folder, and the
    dry run lists what it would send by the same sizes."""
    secret = tmp_path / "home" / "alice" / "secret-project"
    student, _ = vitconvert.convert(tiny_model("vit"), "elu", source=str(secret / "src"))
    folder = vitconvert.save(student, tmp_path / "m")
    (folder / "recipe.yaml").write_text(f"# my recipe\ndataset:\n  data: {secret / 'images'}\nepochs: 2\n")
    (folder / "metrics.jsonl").write_text('{"epoch": 1, "val_top1": 0.5}\n')
    planned = push_folder(folder, "me/x", dry_run=True)
    assert planned.shown_by_name == {str(secret / "src"): "src (local)", str(secret / "images"): "images (local)"}
    repo = LocalRepo(monkeypatch, {})
    push_folder(folder, "me/x", token=FAKE_TOKEN)
    assert sorted(repo.files) == sorted(name for name, _ in planned.files)
    assert {name: len(data) for name, data in repo.files.items()} == dict(planned.files)
    assert [name for name, data in repo.files.items() if b"secret-project" in data] == []
    sent = json.loads(repo.files["config.json"])
    assert sent["vitconvert"]["source"] == "src (local)" and "`src (local)`" in repo.files["README.md"].decode()
    assert repo.files["recipe.yaml"].decode() == "# my recipe\ndataset:\n  data: images (local)\nepochs: 2\n"
    assert repo.files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert read_config(folder)["vitconvert"]["source"] == str(secret / "src")  # the tools' copy keeps the path
    downloaded = tmp_path / "downloaded"  # as another user gets it: the model loads, the teacher must be named
    downloaded.mkdir()
    for name, data in repo.files.items():
        (downloaded / name).write_bytes(data)
    from vitconvert.loading import load_teacher, teacher_spec

    student = vitconvert.load(downloaded)
    with pytest.raises(VitconvertError, match=r"the student's source, src \(local\), was a local folder or file "
                                              r"where it was converted .*: name its softmax teacher with teacher"):
        load_teacher(teacher_spec(student, None), student, seed=0, recorded=True)
