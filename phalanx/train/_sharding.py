"""FSDP2 and sharded checkpoints through torch.distributed.checkpoint (DCP).

Imported only when a script asks for FSDP or a sharded checkpoint: FSDP and DCP pull in more of
torch.distributed than `import phalanx.train` should pay for.

A sharded checkpoint is a DCP folder: every rank writes its own shards (`__N_0.distcp`), rank 0
writes `.metadata` once all have written, and DCP's own collectives order that. The same folder
loads into FSDP2, DDP or a single-process model, at any world size (DCP reshards on load).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any

import fsspec
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# The keys of a sharded checkpoint's top-level state dict.
MODEL, OPTIMIZER, EXTRA = "model", "optimizer", "extra"


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one before the root: every member of every ModuleList (a
    transformer's blocks, by convention). Each unit's parameters are gathered just before it runs
    and freed after, so peak memory holds one block's full weights at a time."""
    return [member for module in model.modules() if isinstance(module, nn.ModuleList) for member in module]


def shard_model(
    model: nn.Module, precision: str, units: Callable[[nn.Module], list[nn.Module]] | None = None
) -> nn.Module:
    """FSDP2 (`fully_shard`) over `units(model)` (default: `default_units`), then over the root.

    bf16-mixed/fp16-mixed compute in that dtype and reduce gradients in fp32, FSDP's own mixed
    precision: the all-gathers move half the bytes that fp32 would."""
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    for unit in (units or default_units)(model):
        fully_shard(unit, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _writer(path: str) -> Any:
    fs, root = fsspec.core.url_to_fs(path)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols or "local" in protocols:
        # No fsync on the training thread (DCP's default is one per file, waited for by every
        # rank): the checkpoint writer's background thread flushes the folder before the commit.
        return FileSystemWriter(root, sync_files=False)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(path)


def _reader(path: str) -> Any:
    fs, root = fsspec.core.url_to_fs(path)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols or "local" in protocols:
        return FileSystemReader(root)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(path)


def save_sharded(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any]
) -> None:
    """Write the model's (and optimizer's) state to `path` as a DCP checkpoint; every rank calls it."""
    if optimizer is None:
        state: dict[str, Any] = {MODEL: get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {MODEL: model_state, OPTIMIZER: optimizer_state}
    state[EXTRA] = _pack(extra)
    dcp_save(state, storage_writer=_writer(path))


def load_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load a DCP checkpoint into `model` (and `optimizer`) in place; return its `extra`."""
    if optimizer is None:
        state: dict[str, Any] = {MODEL: get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {MODEL: model_state, OPTIMIZER: optimizer_state}
    state[EXTRA] = b""  # a placeholder for DCP to replace with what was saved
    dcp_load(state, storage_reader=_reader(path))
    if optimizer is None:
        set_state_dict(model, (), model_state_dict=state[MODEL], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state[MODEL], optim_state_dict=state[OPTIMIZER])
    return _unpack(state[EXTRA])


def _pack(extra: Mapping[str, Any]) -> bytes:
    """`extra` as one opaque value: DCP would otherwise flatten nested dicts and lists into keys
    that a loader must know in advance."""
    buffer = io.BytesIO()
    torch.save(dict(extra), buffer)
    return buffer.getvalue()


def _unpack(packed: bytes) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(io.BytesIO(packed), weights_only=False)
    return loaded


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU, on rank 0 (gathered from the shards under FSDP; the other
    ranks take part and get an empty dict)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
    return {key: value for key, value in get_model_state_dict(model, options=options).items() if torch.is_tensor(value)}
