"""Fixtures of the distill tests: one converted tiny student and one image folder per test module."""

from __future__ import annotations

import pytest

from .helpers import make_images, make_student


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return make_student(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("images"))
