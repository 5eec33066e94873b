"""Pin torch's CPU thread count for one job and restore it after (bench and quickstart both need it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch

from .errors import BadValue


@contextmanager
def torch_threads(threads: Optional[int]) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads (None: leave as is); the caller's count comes back."""
    if threads is not None and threads < 1:
        raise BadValue("threads", f"must be at least 1 (got {threads})")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
