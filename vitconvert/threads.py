"""Pin torch's CPU thread count for one job and restore it after (bench and quickstart both need it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch

from .errors import BadValue

PER_CORE = 8  # oversubscribing a little is a choice (timing tests); 100000 threads fail to start mid-run


def cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextmanager
def torch_threads(threads: Optional[int]) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads (None: leave as is); the caller's count comes back."""
    if threads is not None and threads < 1:
        raise BadValue("threads", f"must be at least 1 (got {threads})")
    if threads is not None and threads > PER_CORE * cores():
        raise BadValue("threads", f"{threads} is more than {PER_CORE} per core of this machine's {cores()} (at most "
                                  f"{PER_CORE * cores()}): more only wait on each other, and past the system's limit "
                                  "they cannot start")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
