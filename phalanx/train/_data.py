"""`prepare_data_loader`: shard a DataLoader across ranks and keep the shuffle epoch-aware."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)


class WaitClock:
    """Seconds this process's prepared loaders spent producing batches (the training loop waited
    for them): read by the communication figures as the steps' data time."""

    def __init__(self) -> None:
        self.seconds = 0.0


data_wait = WaitClock()


def _timed(batches: Iterator[Any], clock: WaitClock) -> Iterator[Any]:
    while True:
        start = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            clock.seconds += time.perf_counter() - start
            return
        clock.seconds += time.perf_counter() - start
        yield batch


class PreparedDataLoader(DataLoader[Any]):
    """A DataLoader that calls `sampler.set_epoch()` on every pass and moves batches to the device.

    Each `iter()` is one epoch: the first pass uses epoch 0 (or what `set_epoch` gave, e.g. after
    resuming), so every rank draws the same permutation of the same epoch and they stay disjoint.
    """

    def __init__(self, *args: Any, device: torch.device, move_to_device: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0
        self.device = device
        self.move_to_device = move_to_device and device.type != "cpu"

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass uses (later passes count up from it)."""
        self.epoch = epoch

    # DataLoader.__iter__ is typed as returning its private iterator class; a generator that moves
    # batches is the point of this override.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        self.epoch += 1
        batches = _timed(super().__iter__(), data_wait)
        if not self.move_to_device:
            return batches
        return (_to_device(batch, self.device) for batch in batches)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_to_device(value, device) for value in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(value, device) for value in batch)
    return batch


def prepare_data_loader(
    loader: DataLoader[Any],
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    move_to_device: bool = True,
) -> PreparedDataLoader:
    common: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        "device": device,
        "move_to_device": move_to_device,
    }
    if hasattr(loader, "in_order"):  # torch >= 2.6
        common["in_order"] = loader.in_order
    dataset = loader.dataset

    if isinstance(dataset, IterableDataset):
        # An iterable dataset has no indices to split: it must shard itself (by rank/world_size).
        return PreparedDataLoader(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **common)

    if world_size == 1:
        # Keep the user's own sampler: the ported script then draws exactly the batches the
        # plain script drew, so a single-process run reproduces it bit for bit.
        if loader.batch_size is None:
            return PreparedDataLoader(dataset, batch_size=None, sampler=loader.sampler, batch_sampler=None, **common)
        return PreparedDataLoader(dataset, batch_sampler=loader.batch_sampler, **common)

    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        distributed = sampler
    elif type(sampler) is SequentialSampler or type(sampler) is RandomSampler:
        if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler._num_samples is not None):
            raise ValueError(
                "prepare_data_loader cannot shard a RandomSampler with replacement or num_samples; "
                "pass a DistributedSampler yourself"
            )
        distributed = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=isinstance(sampler, RandomSampler),
        )
    else:
        raise ValueError(
            f"prepare_data_loader cannot shard a {type(sampler).__name__} across ranks; "
            "build the DataLoader with shuffle=True/False or a DistributedSampler"
        )

    if loader.batch_size is None:
        if type(loader.batch_sampler) not in (type(None), BatchSampler):
            raise ValueError("prepare_data_loader cannot shard a custom batch_sampler across ranks")
        return PreparedDataLoader(dataset, batch_size=None, sampler=distributed, **common)
    return PreparedDataLoader(
        dataset, batch_size=loader.batch_size, sampler=distributed, drop_last=loader.drop_last, **common
    )
