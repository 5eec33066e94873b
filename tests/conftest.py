"""Session setup and fixtures; shared helpers live in tests/helpers.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the fused kernels' tests run in Triton's interpreter, which must be chosen
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before timm imports triton (attention/test_fused.py)

from helpers import tiny_model  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
torch.set_num_threads(1)  # pytest -n 2 runs two workers on two cores: one thread each, no oversubscription


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: minutes of CPU (torch.compile / inductor); run with `pytest -m slow`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests run only when asked for (``-m slow``, or any -m expression naming slow)."""
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with `python -m pytest -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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
