"""Devices and data parallelism: CPU, CUDA, many processes (torchrun + DDP), and XLA (TPU).

* One process: ``device="auto"`` picks CUDA if present, else the CPU; ``"xla"`` uses torch-xla
  (imported only then, so it stays optional).
* Many processes, CPU or GPU: start with ``torchrun --nproc-per-node N -m bayesify train ...``.
  :func:`setup` reads ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, joins the process group
  (``gloo`` on the CPU, ``nccl`` on GPUs) and the trainer wraps the model in
  ``DistributedDataParallel``, which averages gradients across processes.
* Many XLA devices (TPU cores): ``bayesify train --device xla --nprocs N`` starts one process
  per device with ``torch_xla.launch``; gradients are averaged with
  ``xm.reduce_gradients`` before each optimizer step (the torch-xla equivalent of DDP).

Every process sees ``batch_size / world_size`` examples per step, so the global batch (and the
learning rate recipe) does not depend on the number of processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Distributed", "resolve_device", "setup"]


@dataclass
class Distributed:
    """Where this process runs and who its peers are."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # "gloo" / "nccl" when a torch.distributed group was initialised here
    xla: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ddp(self) -> bool:
        return self.world_size > 1 and not self.xla

    def wrap(self, model: nn.Module) -> nn.Module:
        """``DistributedDataParallel(model)`` for multi-process CPU / GPU runs, else ``model``."""
        if not self.ddp:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Average gradients across XLA replicas (DDP does this itself during ``backward``)."""
        if self.xla and self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.reduce_gradients(optimizer)

    def mark_step(self) -> None:
        """Cut and run the lazily traced XLA graph (no-op elsewhere)."""
        if self.xla:
            import torch_xla

            torch_xla.sync()

    def barrier(self) -> None:
        if self.xla and self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous("bayesify")
        elif dist.is_available() and dist.is_initialized():
            dist.barrier()

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of ``value`` over processes (for logging)."""
        if self.world_size == 1:
            return value
        if self.xla:
            import torch_xla.core.xla_model as xm

            return xm.all_reduce(xm.REDUCE_SUM, value) / self.world_size
        value = value.clone()
        dist.all_reduce(value)
        return value / self.world_size

    def shutdown(self) -> None:
        """Leave the process group if :func:`setup` joined one."""
        if self.backend is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.backend = None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or ``"xla"``."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("xla"):
        try:
            import torch_xla
        except ImportError:
            raise ValueError(
                "device='xla' needs torch-xla, which is not installed; install it next to its matching torch "
                "(e.g. pip install torch==2.9.0 torch_xla==2.9.0, see `make test-xla`), or use --device cpu / cuda."
            ) from None
        return torch_xla.device()
    try:
        parsed = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device={name!r} is not a device; use auto, cpu, cuda, cuda:N or xla.") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available here; use --device cpu (or auto).")
    return parsed


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def setup(device: str | torch.device = "auto", *, backend: str | None = None) -> Distributed:
    """Resolve the device and join the process group that launched this process, if any.

    Under ``torchrun`` (``WORLD_SIZE > 1``) the process group is initialised here with
    ``backend`` (default ``nccl`` for CUDA, ``gloo`` otherwise) unless one already exists; each
    process takes ``cuda:LOCAL_RANK``. Under torch-xla, rank and world size come from the XLA
    runtime.
    """
    name = str(device)
    if name.startswith("xla"):
        resolved = resolve_device(name)
        import torch_xla.runtime as xr

        return Distributed(resolved, rank=xr.global_ordinal(), world_size=xr.world_size(), xla=True)

    world_size = _env_int("WORLD_SIZE", 1)
    if dist.is_available() and dist.is_initialized():  # a caller set up the group itself
        world_size = dist.get_world_size()
    if world_size <= 1:
        return Distributed(resolve_device(name))

    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if dist.is_initialized():
        rank = dist.get_rank()
    resolved = resolve_device(name)
    if resolved.type == "cuda":
        resolved = torch.device("cuda", local_rank)
        torch.cuda.set_device(resolved)
    joined = None
    if not dist.is_initialized():
        joined = backend or ("nccl" if resolved.type == "cuda" else "gloo")
        dist.init_process_group(joined, rank=rank, world_size=world_size)
    return Distributed(resolved, rank=rank, world_size=world_size, local_rank=local_rank, backend=joined)


def launch_xla(fn: Any, args: tuple = (), nprocs: int | None = None) -> None:
    """Run ``fn(*args)`` in one process per XLA device (``torch_xla.launch``)."""
    import torch_xla

    if nprocs is not None and nprocs > 1:
        os.environ.setdefault("CPU_NUM_DEVICES", str(nprocs))  # for PJRT_DEVICE=CPU test runs
    torch_xla.launch(fn, args=args)
