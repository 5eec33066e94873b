"""Running loss sums of a distill run: each term × images, and the image count, summed on the device.

They stay on the device (no host sync per step) until a log line, an epoch end or a checkpoint reads them;
``all_reduce`` sums them over the processes of a DDP/FSDP run, so every mean is over all the images seen.
A checkpoint stores them as a plain list (``to_list``) in the order of ``TERMS`` plus the count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .. import distributed as D

TERMS = ("loss", "task", "attn", "kd")


class RunningSums:
    """``TERMS`` × images and the image count, as one float64 tensor on ``device``."""

    def __init__(self, device: torch.device, saved: Sequence[float] = ()):
        self.values = torch.tensor(list(saved) or [0.0] * (len(TERMS) + 1), dtype=torch.float64, device=device)

    @classmethod
    def of_batch(cls, out: Mapping[str, torch.Tensor], images: int, device: torch.device) -> RunningSums:
        """One micro-batch's sums from the task's output (a term it did not compute counts 0)."""
        sums = cls.__new__(cls)
        loss = out["loss"].detach()
        zero = loss.new_zeros(())
        terms = torch.stack([loss] + [out.get(k, zero) for k in TERMS[1:]]).double()
        count = torch.tensor([images], dtype=torch.float64, device=device)
        sums.values = torch.cat([terms * images, count])
        return sums

    def add(self, other: RunningSums) -> None:
        """Add another set of sums (a micro-batch's) in place."""
        self.values += other.values

    def all_reduce(self, env: D.DistEnv) -> RunningSums:
        """The sums over every process (a collective: every rank calls), as a new object."""
        total = RunningSums.__new__(RunningSums)
        total.values = D.all_sum(env, self.values.clone())  # all_sum reduces in place
        return total

    @property
    def images(self) -> float:
        """How many images the sums cover: the divisor of every mean."""
        return float(self.values[-1])

    def total(self, term: str) -> float:
        """The sum of one loss term (a name of TERMS)."""
        return float(self.values[TERMS.index(term)])

    def mean(self) -> dict[str, float]:
        """Each term per image."""
        n = self.images
        return {k: float(self.values[i]) / n for i, k in enumerate(TERMS)}

    def finite(self) -> bool:
        """Whether every sum is finite: a NaN loss stops the run before it is saved."""
        return bool(torch.isfinite(self.values).all())

    def reset(self) -> None:
        """Zero the sums for the next window or epoch."""
        self.values.zero_()

    def to_list(self) -> list[float]:
        """The sums as plain floats, as trainer.json stores them for a resume."""
        return self.values.tolist()
