"""torch.distributed for distill: torchrun's environment, DDP/FSDP wrapping, reductions. One process = no-ops.

Under ``torchrun`` (RANK/WORLD_SIZE set) each process trains on its share of the data; gradients are
averaged by DDP (or FSDP for models too large to replicate), metrics are summed across processes, and only
rank 0 writes files.
"""

from __future__ import annotations

import os
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .errors import BadValue, VitconvertError

COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # torch's own default for a process group


@dataclass
class DistEnv:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        """Whether several processes train (torchrun with WORLD_SIZE > 1)."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one process that prints and writes."""
        return self.rank == 0


def pick_device(requested: Optional[str], local_rank: int) -> torch.device:
    """The device asked for (refused in one line when this machine has none), else this rank's GPU or the CPU."""
    if requested:
        try:
            device = torch.device(requested)
        except RuntimeError:
            raise BadValue("device", f"unknown device {requested!r} (cpu, cuda, cuda:1, mps)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BadValue("device", f"{requested}: no CUDA GPU is available")
        if device.type not in ("cpu", "cuda"):
            try:
                torch.empty(0, device=device)
            except (RuntimeError, AssertionError):
                raise BadValue("device", f"{requested} is not available on this machine (or this PyTorch build); "
                                           "use cpu or cuda") from None
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank)
        return device
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def launcher_int(name: str) -> int:
    """A torchrun variable (WORLD_SIZE, RANK, LOCAL_RANK) as a non-negative integer; unset: its one-process value."""
    text = os.environ.get(name, "1" if name == "WORLD_SIZE" else "0").strip()
    if not text.isdigit() or (name == "WORLD_SIZE" and int(text) < 1):
        kind = "positive" if name == "WORLD_SIZE" else "non-negative"
        raise VitconvertError(f"the environment variable {name}={text!r} is not a {kind} integer: it is torchrun's "
                              "to set; unset it to run one process")
    return int(text)


def launcher() -> tuple[int, int, int]:
    """torchrun's (WORLD_SIZE, RANK, LOCAL_RANK), read once and checked together: a rank at or past the world size
    (a stray RANK=3 beside WORLD_SIZE=1) would make a process that is nobody's main one train silently."""
    world, rank, local_rank = (launcher_int(name) for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        if value >= world:
            raise VitconvertError(f"the environment variable {name}={value} is not below WORLD_SIZE={world} (ranks "
                                  f"run from 0 to {world - 1}): these are torchrun's to set; unset {name} and "
                                  "WORLD_SIZE to run one process")
    if world > 1 and ("RANK" not in os.environ or "MASTER_ADDR" not in os.environ):
        raise VitconvertError(f"WORLD_SIZE={world} is set but RANK or MASTER_ADDR is not: start the command with "
                              "torchrun (which sets them all), or unset WORLD_SIZE for one process")
    return world, rank, local_rank


def is_main_process() -> bool:
    """Rank 0 prints and pushes (one process: always)."""
    return launcher()[1] == 0


def setup(requested_device: Optional[str] = None) -> DistEnv:
    """Read torchrun's environment; start the process group (NCCL on GPUs, gloo on CPUs) when world > 1."""
    world, rank, local_rank = launcher()
    device = pick_device(requested_device, local_rank)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        from .rendezvous import meet  # lazy: start-up time (only several processes meet)

        store = meet(rank, world)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world)
        store.set_timeout(COLLECTIVE_TIMEOUT)  # met: now a slow rank 0 (saving, comparing) is no failure
    return DistEnv(rank, world, local_rank, device)


def teardown(env: DistEnv) -> None:
    """Leave the process group, so torchrun's processes exit together."""
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def all_sum(env: DistEnv, values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over processes (float64 on the reducing device)."""
    values = values.detach().to(env.device, torch.float64)
    if env.distributed:
        dist.all_reduce(values)
    return values


def any_rank(env: DistEnv, flag: bool) -> bool:
    """True on every process when it is true on any (a stop request must be agreed on, or ranks deadlock)."""
    if not env.distributed:
        return flag
    return bool(all_sum(env, torch.tensor([float(flag)])).item() > 0)


def gather(env: DistEnv, obj: Any) -> list[Any]:
    """Every process's ``obj`` (small picklable state, e.g. RNG states), in rank order."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world
    dist.all_gather_object(out, obj)
    return out


def barrier(env: DistEnv) -> None:
    """Wait for every process (one process: nothing to wait for)."""
    if env.distributed:
        dist.barrier()


def replicate(module: nn.Module, env: DistEnv) -> nn.Module:
    """DDP over the currently trainable parameters (a no-op in one process)."""
    if not env.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel

    # A depthwise conv weight (MHLA's LePE, [C, 1, k, k]) gets its gradient with another stride on the size-1
    # dimension than the parameter's ([25, 1, 5, 1] vs [25, 25, 5, 1]): the same memory layout, which DDP's
    # reducer copies once per step and warns about on every rank. Harmless; not worth a line from each rank.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    return DistributedDataParallel(module, device_ids=[env.device.index] if env.device.type == "cuda" else None)


def shard(module: nn.Module, env: DistEnv, attention_types: tuple[type, ...]) -> nn.Module:
    """FSDP2 in place: each attention and MLP module a shard unit (teacher-forced calls unshard them alone)."""
    from timm.layers import GluMlp, Mlp, SwiGLU
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not env.distributed:
        raise BadValue("fsdp", "needs several processes: start the command with torchrun, N processes")
    mesh = init_device_mesh(env.device.type, (env.world,))
    units = (*attention_types, Mlp, GluMlp, SwiGLU)
    for sub in list(module.modules()):
        if sub is not module and isinstance(sub, units):
            fully_shard(sub, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def is_fsdp(module: Optional[nn.Module]) -> bool:
    """Whether the module is sharded by FSDP2, whose state dicts need torch's distributed helpers."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def gradient_sync(wrapped: Optional[nn.Module], sync: bool) -> AbstractContextManager:
    """Skip the gradient all-reduce on accumulation micro-steps (DDP's no_sync, FSDP2's requires_gradient_sync)."""
    if is_fsdp(wrapped):
        wrapped.set_requires_gradient_sync(sync)  # type: ignore[union-attr]
        return nullcontext()
    if sync or not hasattr(wrapped, "no_sync"):
        return nullcontext()
    return wrapped.no_sync()  # type: ignore[union-attr]


def reshard(module: nn.Module) -> None:
    """FSDP2 keeps the root unsharded after a forward; state-dict helpers need the sharded parameters back."""
    for sub in module.modules():
        if is_fsdp(sub):
            sub.reshard()  # type: ignore[attr-defined]


def full_model_state(wrapped: Optional[nn.Module], plain: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU, gathered from shards under FSDP (a collective: call on all ranks)."""
    if is_fsdp(wrapped):
        reshard(plain)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(plain, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in plain.state_dict().items()}
