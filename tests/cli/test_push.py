"""``vitconvert push``: the dry-run listing a person reads, one-line errors, and a token that never shows."""

from __future__ import annotations

import json

import pytest
from helpers import FAKE_TOKEN, FakeHub, assert_one_line_error, runner

from vitconvert.cli import app


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})




def test_dry_run_shows_the_repo(tmp_path, online, no_network, make_folder):
    folder = make_folder(tmp_path / "run", variant="ttt", run=True)
    result = invoke("push", str(folder), "--repo", "me/x", "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "would upload to me/x" in out and "6 files" in out
    for name in ("README.md", "config.json", "model.safetensors", "recipe.yaml", "metrics.jsonl", "curves.png"):
        assert name in out
    size_kb = (folder / "model.safetensors").stat().st_size / 1000
    assert f"{size_kb:.1f} kB" in out
    assert "not uploaded: best/, checkpoint-last/, events.out.tfevents.1, optimizer.pt" in out
    assert "README.md: refreshed from config.json when pushed (a dry run writes nothing)" in out
    assert "nothing was sent" in out and "no token yet" in out


def test_dry_run_json(tmp_path, online, no_network, make_folder):
    result = invoke("push", str(make_folder(tmp_path / "m")), "--repo", "me/x", "--revision", "v1", "--dry-run",
                    "--json")
    plan = json.loads(result.stdout)
    assert plan["repo_id"] == "me/x" and plan["revision"] == "v1" and plan["dry_run"] is True
    assert [name for name, _ in plan["files"]] == ["README.md", "config.json", "model.safetensors"]
    assert plan["url"] == "https://huggingface.co/me/x/tree/v1"


def test_push_prints_the_repo_and_never_the_token(tmp_path, monkeypatch, online, make_folder):
    folder = make_folder(tmp_path / "run", run=True)
    hub = FakeHub(monkeypatch)
    result = invoke("push", str(folder), "--repo", "me/x", "--private", "--token", FAKE_TOKEN,
                    "--commit-message", "hello")
    assert result.exit_code == 0, result.output
    assert "pushed https://huggingface.co/me/x" in result.stdout
    assert hub.kwargs("upload_folder")["commit_message"] == "hello" and hub.kwargs("create_repo")["private"] is True
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    result_env = invoke("push", str(folder), "--repo", "me/x", "--json")
    assert result_env.exit_code == 0 and json.loads(result_env.stdout)["token_source"] == "HF_TOKEN"
    for r in (result, result_env, invoke("push", str(folder), "--repo", "me/x", "--dry-run")):
        assert FAKE_TOKEN not in r.output
    assert not any(FAKE_TOKEN.encode() in f.read_bytes() for f in tmp_path.rglob("*") if f.is_file())


def test_errors_are_one_line(tmp_path, monkeypatch, online, make_folder):
    folder = make_folder(tmp_path / "m")
    assert_one_line_error(invoke("push", str(folder), "--repo", "not a repo"), "expected org/name")
    assert_one_line_error(invoke("push", str(tmp_path / "missing"), "--repo", "me/x"), "folder not found")
    assert_one_line_error(invoke("push", str(folder), "--repo", "me/x"), "hf auth login")
    FakeHub(monkeypatch, fail={"upload_folder": ConnectionError("Max retries exceeded")})
    assert_one_line_error(invoke("push", str(folder), "--repo", "me/x", "--token", FAKE_TOKEN),
                          "cannot reach the Hugging Face Hub")


def test_offline_env_blocks_push_but_not_dry_run(tmp_path, monkeypatch, make_folder):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = make_folder(tmp_path / "m")
    assert invoke("push", str(folder), "--repo", "me/x", "--dry-run").exit_code == 0
    assert_one_line_error(invoke("push", str(folder), "--repo", "me/x", "--token", FAKE_TOKEN), "HF_HUB_OFFLINE")
    (folder / "model.safetensors").write_bytes(b"not weights")  # said before loading the folder (seconds or more)
    assert_one_line_error(invoke("push", str(folder), "--repo", "me/x", "--token", FAKE_TOKEN), "HF_HUB_OFFLINE")


@pytest.mark.parametrize("source", ["hf-hub:timm/tiny_vit", "hf-hub:timm/tiny_vit@main"])
def test_convert_from_hub_cache_offline(tmp_path, monkeypatch, source):
    import huggingface_hub
    import timm
    from helpers import assert_one_line_error, place_in_hub_cache, tiny_model

    cache = tmp_path / "cache"
    timm.models.save_for_hf(tiny_model("vit"), str(tmp_path / "src"), safe_serialization=True)
    place_in_hub_cache(cache, "timm/tiny_vit", tmp_path / "src")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke("convert", source, "--to", "relu", "--attn-init", "copy", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vitconvert"]["source"] == source
    assert_one_line_error(invoke("convert", "hf-hub:timm/tiny_vit@v9", "--to", "relu"),
                          "timm/tiny_vit@v9 is not in the Hub cache and HF_HUB_OFFLINE is set")


def test_convert_from_a_local_folder_then_push_shows_its_name_not_its_path(tmp_path, online, no_network,
                                                                            monkeypatch):
    """`convert ./src` records /…/secret-project/src (compare and distill find the teacher from anywhere); the card
    and the dry run's listing say `src (local)`, and the dry run says which local paths go by name."""
    import timm
    from helpers import tiny_model

    project = tmp_path / "alice" / "secret-project"
    project.mkdir(parents=True)
    timm.models.save_for_hf(tiny_model("vit"), str(project / "src"), safe_serialization=True)
    monkeypatch.chdir(project)
    assert invoke("convert", "./src", "--to", "elu", "--out", "m").exit_code == 0
    assert json.loads((project / "m" / "config.json").read_text())["vitconvert"]["source"] == str(project / "src")
    card = (project / "m" / "README.md").read_text()
    assert "secret-project" not in card and "| source | `src (local)` |" in card
    result = invoke("push", "m", "--repo", "me/x", "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"local paths sent by name only: {project / 'src'} -> src (local)" in result.stdout
    plan = json.loads(invoke("push", "m", "--repo", "me/x", "--dry-run", "--json").stdout)
    assert plan["shown_by_name"] == {str(project / "src"): "src (local)"}
