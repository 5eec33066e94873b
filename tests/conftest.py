"""Session setup and fixtures; shared helpers live in tests/helpers.py."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import HfApi

if not torch.cuda.is_available():  # the fused kernels' tests run in Triton's interpreter, which must be chosen
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before timm imports triton (attention/test_fused.py)

from helpers import interpreter_patches_once, interpreter_rounds_to_nearest, tiny_model  # noqa: E402

import vitconvert  # noqa: E402
from vitconvert.attention.ops import dispatch  # noqa: E402

if dispatch.interpreting() and dispatch.triton_available():
    interpreter_rounds_to_nearest()  # bf16 casts as the GPU rounds them (helpers.py says why)
    interpreter_patches_once()  # a launch patches triton.language once, not at every helper call (helpers.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
torch.set_num_threads(1)  # pytest -n 2 runs two workers on two cores: one thread each, no oversubscription


@pytest.fixture
def kernels_on_the_cpu():
    """The fused kernels on the CPU too (Triton's interpreter) for one test: the GPU's path of every variant."""
    with dispatch.kernels_on("cpu") as inner:
        yield inner


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: minutes of CPU (torch.compile / inductor); run with `pytest -m slow`")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (its worker's hook renames the grouped tests)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of a module that share a module-scoped fixture run on one xdist worker (pyproject: --dist
    loadgroup), so the fixture is built once, not once per worker; ``slow`` tests run only when asked for (``-m
    slow``, or any -m expression naming slow)."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d and d[-1].scope in ("module", "class") for d in defs.values()):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with `python -m pytest -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)  # after xdist's worker renamed the grouped tests, before it sends their ids
def pytest_collection_finish(session: pytest.Session) -> None:
    """Each grouped test's id ends in ``@group``, which is what xdist's controller schedules by. pytest-xdist 3.8
    renames by setting ``item._nodeid``, which pytest 9 no longer reads (the id is ``item._id``): the groups were
    lost and every worker built each module's fixture (tests/test_gpu_check.py's dry run twice)."""
    if not getattr(session.config.option, "loadgroup", False):  # (set in an xdist worker under --dist loadgroup)
        return
    for item in session.items:
        group = item.get_closest_marker("xdist_group")
        renamed = item.nodeid.rfind("@") > item.nodeid.rfind("]")  # (as xdist's scheduler reads a group)
        if group and not renamed and hasattr(type(getattr(item, "_id", None)), "parse"):
            item._id = type(item._id).parse(f"{item.nodeid}@{group.args[0]}")


@pytest.fixture
def vit() -> torch.nn.Module:
    return tiny_model("vit")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty offline Hub cache (huggingface_hub's layout, `helpers.place_in_hub_cache` fills it) that timm,
    huggingface_hub and vitconvert all read; HF_HUB_OFFLINE is set in the environment and in the constant."""
    import huggingface_hub.constants as c

    cache = tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread; two spin against each other on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- Hub: converted folders to push, and a Hub that is never reached (tests/test_hub.py, tests/cli/test_push.py)
@pytest.fixture(scope="session")
def templates(tmp_path_factory) -> dict[str, Path]:
    """One converted tiny folder per variant for the whole session (Mimetic init is the slow part)."""
    return {}


@pytest.fixture
def make_folder(templates, tmp_path_factory):
    """make_folder(path, variant="elu", run=False): a converted tiny model folder at ``path``; ``run`` adds
    what a distill run folder holds beside the model (recipe, metrics, curves, checkpoints)."""
    def make(path: Path, variant: str = "elu", run: bool = False) -> Path:
        if variant not in templates:
            student, _ = vitconvert.convert(tiny_model("vit"), variant, source="vit_tiny")
            templates[variant] = vitconvert.save(student, tmp_path_factory.mktemp("tpl") / variant, pretrained=False)
        shutil.copytree(templates[variant], path)
        if run:
            (path / "recipe.yaml").write_text("# quick recipe\ndata:\n  dataset: torch/cifar10\nepochs: 2\n")
            (path / "metrics.jsonl").write_text('{"epoch": 0, "top1": 10.0}\n{"epoch": 1, "top1": 12.5}\n')
            (path / "curves.png").write_bytes(b"\x89PNG fake")
            (path / "checkpoint-last").mkdir()
            (path / "checkpoint-last" / "optimizer.pt").write_bytes(b"state")
            (path / "best").mkdir()
            (path / "best" / "model.safetensors").write_bytes(b"weights")
            (path / "events.out.tfevents.1").write_bytes(b"tb")
            (path / "optimizer.pt").write_bytes(b"state")
        return path

    return make


@pytest.fixture
def online(monkeypatch):
    """Offline mode off (conftest turns it on) and no ambient login, so tests decide where the token comes from."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection or Hub call fails the test (whatever offline mode says)."""
    def refuse(*args, **kwargs):
        raise AssertionError("network access")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    for name in ("create_repo", "create_branch", "upload_folder"):
        monkeypatch.setattr(HfApi, name, refuse)
    monkeypatch.setattr(huggingface_hub, "get_token", refuse)
