"""A batch sampler whose order is a pure function of (seed, epoch, rank): resumable mid-epoch.

Each epoch draws a permutation from its own generator seeded with ``(seed, epoch)``, drops the
tail that does not fill a global batch, and deals it out to ranks DistributedSampler-style
(``rank::world_size``), so that the union of the ranks' batches at step t is exactly the global
batch a single process would draw at step t. ``start`` skips the batches an interrupted run
already consumed, without loading them: together with the restored model, optimizer and RNG
states, a resumed run sees the very same data as an uninterrupted one.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler

__all__ = ["ResumableBatchSampler"]


class ResumableBatchSampler(Sampler[list[int]]):
    """Shuffled, sharded, fixed-size batches of dataset indices.

    Args:
        size: number of examples in the dataset.
        batch_size: examples per batch *per rank* (global batch = ``batch_size * world_size``).
        seed: base seed of the per-epoch permutations.
        rank, world_size: this process's shard.
        shuffle: permute each epoch (False: dataset order).

    Raises:
        ValueError: a global batch larger than the dataset (no full batch to draw).
    """

    def __init__(
        self, size: int, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1, shuffle: bool = True
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1.")
        if batch_size * world_size > size:
            raise ValueError(
                f"a global batch of {batch_size * world_size} examples ({batch_size} x {world_size} processes) is larger "
                f"than the {size} training examples, so no full batch can be drawn; use --batch-size {size} or less."
            )
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.epoch, self.start = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.size // (self.batch_size * self.world_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Draw the order of ``epoch`` and begin at its batch number ``start``."""
        if not 0 <= start <= self.batches_per_epoch:
            raise ValueError(f"start={start} must be within the {self.batches_per_epoch} batches of an epoch.")
        self.epoch, self.start = epoch, start

    def order(self, epoch: int) -> torch.Tensor:
        """The indices (all ranks, before sharding) that ``epoch`` uses, in order."""
        if not self.shuffle:
            perm = torch.arange(self.size)
        else:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.size, generator=generator)
        return perm[: self.batches_per_epoch * self.batch_size * self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        shard = self.order(self.epoch)[self.rank :: self.world_size]
        for i in range(self.start, self.batches_per_epoch):
            yield shard[i * self.batch_size : (i + 1) * self.batch_size].tolist()

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start
