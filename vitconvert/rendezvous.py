"""Where torchrun's processes meet (MASTER_ADDR:MASTER_PORT), said before waiting and waited for a bounded time.

torch's env:// rendezvous waits 30 minutes in silence for a process that may never come (a half-started torchrun,
an environment copied from one): each process says what it waits for, and gives up after VITCONVERT_DIST_TIMEOUT
seconds (default 300) with one line. The wait is the rendezvous alone; collectives keep torch's own timeout.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from .errors import VitconvertError

TIMEOUT_ENV, DEFAULT_TIMEOUT_S = "VITCONVERT_DIST_TIMEOUT", 300.0


def timeout_s() -> float:
    """VITCONVERT_DIST_TIMEOUT as seconds (a positive, finite number)."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise VitconvertError(f"{TIMEOUT_ENV}={text!r}: expected the seconds the processes of a torchrun may take "
                              f"to meet, a positive number (default {DEFAULT_TIMEOUT_S:.0f})")
    return seconds


def address() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, checked."""
    host, port = os.environ.get("MASTER_ADDR", "").strip(), os.environ.get("MASTER_PORT", "").strip()
    if not host or not port.isdigit() or int(port) >= 2 ** 16:
        raise VitconvertError(f"MASTER_ADDR={host!r} MASTER_PORT={port!r}: several processes need the address and "
                              "port (0-65535) where they meet; start the command with torchrun, which sets them, or "
                              "unset WORLD_SIZE and RANK for one process")
    return host, int(port)


def reachable(host: str, port: int, deadline: float) -> str:
    """Wait until ``host:port`` accepts a connection; '' then, else why not (a plain socket: torch's own client
    prints a C++ stack on every failed try)."""
    why = "nothing listens there"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return ""
        except socket.gaierror as e:
            return f"cannot resolve {host}: {e.strerror}"
        except OSError as e:
            why = e.strerror or why
        if time.monotonic() >= deadline:
            return why
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def meet(rank: int, world: int) -> dist.Store:
    """The store of the env:// rendezvous, after every process has joined; a one-line error when they do not
    within the timeout."""
    host, port = address()
    seconds = timeout_s()
    where = f"rank {rank} of {world}"
    print(f"{where}: waiting up to {seconds:g}s for all {world} processes to meet at {host}:{port} "
          f"({TIMEOUT_ENV} sets the wait)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + seconds
    failure = f"no process answers at {host}:{port}"
    serves = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    why = "" if serves else reachable(host, port, deadline)
    if not why:
        try:
            left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
            store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=left))
            return store
        except (RuntimeError, ValueError) as e:  # DistStoreError "1/2 clients joined", DistNetworkError, a used port
            failure, why = f"the processes did not all meet at {host}:{port}", " ".join(str(e).split()) or repr(e)
    raise VitconvertError(f"{where}: {failure} within {seconds:g}s ({why}): start all {world} processes (one torchrun "
                          f"starts them together), set {TIMEOUT_ENV} to wait longer, or unset WORLD_SIZE and "
                          "RANK to run one process")
