"""The teacher's outputs for each training micro-batch, computed once and shared by the runs that need them.

The quickstart distils one teacher into five students with one recipe and seed, and a run's batches are a pure
function of (seed, epoch, index) (data/loaders.py): every student's teacher sees the same images, step by step,
so its logits and attention outputs are the same bits in each run. The first run to reach a batch computes them
and writes them here; the others read them back (the teacher's forward was ~15% of a student's training).

The store is an anonymous shared mapping made before the quickstart's workers fork, so every worker sees one
memory; pages are committed only as slots are written (the digits quickstart's 6 epochs write ~154 MB). A run
uses it only when its key (the teacher, the recipe) and the tensors' shapes match the first writer's; a slot past
the capacity is simply not cached. Under spawn nothing is shared, and the quickstart passes no cache.

The lock guards only a flag or the layout record, held for microseconds; a worker killed inside that window
would leave it held for ever. A run that waits longer than ``LOCK_WAIT_S`` stops using the cache and computes
the teacher itself (the same bits: the cache only saves the forward), so a dead worker never stalls the others.
"""

from __future__ import annotations

import json
import math
import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch

SLOTS = 1 << 16  # one flag byte per (epoch, micro-batch) slot
LAYOUT = 1 << 14  # bytes of the layout record: the key and the tensors' shapes, as JSON
CAPACITY = 512 << 20  # bytes of tensor data at most (virtual until written)
LOCK_WAIT_S = 5.0  # the longest a run waits for the lock before it stops using the cache (held for microseconds)


class TeacherCache:
    """Slot ``epoch * micro_per_epoch + batch`` -> (logits, attention outputs), float32, shared across forks."""

    def __init__(self, lock: Optional[Any] = None, capacity: int = CAPACITY, lock_wait_s: float = LOCK_WAIT_S):
        self.start = SLOTS + LAYOUT
        self.memory = mmap.mmap(-1, self.start + capacity)  # MAP_SHARED | MAP_ANONYMOUS
        self.lock = lock if lock is not None else threading.Lock()  # a multiprocessing lock across processes
        self.lock_wait_s = lock_wait_s
        self.abandoned = False  # this process gave up on a lock that stayed held: no more reads or writes
        self.layout: Optional[dict[str, Any]] = None  # this process's copy, once read or written

    @contextmanager
    def _locked(self) -> Iterator[bool]:
        """The lock held inside, yielding True; False, not held, once a wait ran past ``lock_wait_s`` (its holder
        died in the window): from then on this process neither waits nor uses the cache."""
        if self.abandoned or not self.lock.acquire(timeout=self.lock_wait_s):
            self.abandoned = True
            yield False
            return
        try:
            yield True
        finally:
            self.lock.release()

    def _flags(self) -> torch.Tensor:
        return torch.frombuffer(self.memory, dtype=torch.uint8, count=SLOTS)

    def _data(self) -> torch.Tensor:
        return torch.frombuffer(self.memory, dtype=torch.float32, offset=self.start)

    def _read_layout(self) -> Optional[dict[str, Any]]:
        if self.layout is None:
            size = int.from_bytes(self.memory[SLOTS:SLOTS + 4], "little")
            if size:
                self.layout = json.loads(self.memory[SLOTS + 4:SLOTS + 4 + size])
        return self.layout

    def _span(self, slot: int, layout: dict[str, Any]) -> Optional[tuple[int, int]]:
        numel = sum(math.prod(shape) for shape in layout["shapes"])
        if slot >= SLOTS or (slot + 1) * numel * 4 > len(self.memory) - self.start:
            return None
        return slot * numel, (slot + 1) * numel

    def get(self, key: str, slot: int) -> Optional[tuple[torch.Tensor, list[torch.Tensor]]]:
        """The teacher's (logits, attention outputs) for ``slot``, copies of what a run with ``key`` wrote."""
        with self._locked() as held:  # the flag after the data: its release orders the writer's data before this read
            ready = held and slot < SLOTS and bool(self._flags()[slot])
        layout = self._read_layout() if ready else None
        if layout is None or layout["key"] != key:
            return None
        span = self._span(slot, layout)
        if span is None:
            return None
        flat = self._data()[span[0]:span[1]]
        parts = [p.reshape(shape).clone() for p, shape in
                 zip(flat.split([math.prod(s) for s in layout["shapes"]]), layout["shapes"], strict=True)]
        return parts[0], parts[1:]

    def put(self, key: str, slot: int, logits: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        """Keep ``slot``'s outputs for the other runs (nothing when the key, a shape or the capacity differ)."""
        tensors = [logits, *outputs]
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
            return
        mine = {"key": key, "shapes": [list(t.shape) for t in tensors]}
        with self._locked() as held:
            if held and self._read_layout() is None:
                record = json.dumps(mine).encode()
                if len(record) + 4 > LAYOUT:
                    return
                self.memory[SLOTS + 4:SLOTS + 4 + len(record)] = record
                self.memory[SLOTS:SLOTS + 4] = len(record).to_bytes(4, "little")
                self.layout = mine
        if self.abandoned or self.layout != mine:
            return
        span = self._span(slot, mine)
        if span is None:
            return
        torch.cat([t.detach().reshape(-1) for t in tensors], out=self._data()[span[0]:span[1]])
        with self._locked() as held:
            if held:
                self._flags()[slot] = 1
