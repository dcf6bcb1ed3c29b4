"""Distributed checkpoints that resume bit-exactly (lesson 09).

    save(step_path(ckpt, 3), model=model, optimizer=opt, scheduler=sched, step=3, data_position=3)
    state = load(latest(ckpt), model=model, optimizer=opt, scheduler=sched)     # -> TrainState(step=3, ...)
    handle = save(..., async_save=True); ...train on...; handle.result()      # before the next save
    save_deepspeed(engine, ckpt, step=3, data_position=3); load_deepspeed(engine, ckpt)

What a bit-exact resume needs, besides the weights: the optimizer state (AdamW's m, v and step), the
learning-rate schedule's position, the data position (the index of the next global batch) and the random
generators of EVERY rank (dropout masks differ per rank). Forget any one and the resumed run drifts.

Model and optimizer go through PyTorch Distributed Checkpoint (DCP,
https://pytorch.org/docs/stable/distributed.checkpoint.html): ``get_state_dict(model, optimizer)`` names every
tensor by its fully qualified name whatever wraps the model (plain, DDP, FSDP2 ``fully_shard``), each rank
writes its own shards (a replicated tensor once), and ``dcp.load`` reads whatever slice the loading rank needs:
a checkpoint written by 4 DDP ranks loads into 2, or into FSDP2 shards (resharding comes from DCP). An
optimizer that describes its shards to DCP itself (``dcp_state_dict``: the course's ZeRO-1/2, whose state goes
in as pieces of full-length flat tensors, `course_lib.parallel.zero_state`) does so instead of
``get_state_dict``, so a run with the course's ZeRO on 4 ranks also resumes on 2. A module sharded by
`course_lib.parallel.sharded_module.shard_module` (``module.shards``) describes its parameters the same way, and
the state of any optimizer over its shards too (`course_lib.parallel.sharded_state`).
The schedule, step, data position, seed and world size ride in the DCP state dict (one copy). The RNG states
are per rank, so each rank writes its own small file ``rng_rank{R}.pt`` next to DCP's ``*.distcp`` files (the
same scheme serves DeepSpeed, whose ``client_state`` only rank 0 writes). Loaded on another world size, a
rank's RNG stream cannot be continued exactly (rank r of 2 consumed what ranks 2r, 2r+1 of 4 did): `load` then
reseeds every generator from (seed, step, rank) with `reseed` and says so (``TrainState.rng_restored``).

Atomic: every rank writes into ``.tmp-step_000123`` beside the final folder (all ranks must see one folder:
one machine or a shared file system); after a barrier rank 0 renames it to ``step_000123`` (atomic on POSIX),
so a crash mid-save leaves only a hidden temp folder that `latest` ignores. Async
(https://pytorch.org/tutorials/recipes/distributed_async_checkpoint_recipe.html): ``dcp.async_save`` copies the
state to CPU memory while the loop waits (staging), then writes from a thread. torch 2.14 asserts that its
process group has a CPU backend, and the thread's collectives must not share a group with the loop's (two
threads on one group may order their collectives differently on different ranks: a mismatch or a hang), so
an async save runs on its own gloo group (``process_group``, or a new one, destroyed by ``handle.result()``).
DeepSpeed: https://deepspeed.readthedocs.io/en/latest/model-checkpointing.html.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from course_lib.reference import reference_for

__all__ = ["TrainState", "AsyncCheckpoint", "step_path", "checkpoints", "latest", "save", "load", "save_deepspeed",
           "load_deepspeed", "rng_state", "set_rng_state", "reseed"]

_STEP = re.compile(r"step_(\d+)")


@dataclasses.dataclass
class TrainState:
    """Where a run stands: ``step`` steps done, ``data_position`` the index of the next global batch, the
    ``seed`` and ``world_size`` it was saved with, whether this rank's RNG streams were continued exactly
    (``rng_restored``; False after a change of world size: reseeded), the caller's ``extra`` and the ``path``."""

    step: int
    data_position: int
    seed: int = 0
    world_size: int = 1
    rng_restored: bool = True
    extra: dict = dataclasses.field(default_factory=dict)
    path: Path | None = None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _barrier(group=None) -> None:
    if _distributed():
        dist.barrier(group=group)


def step_path(folder, step: int) -> Path:
    """``folder/step_000123``: where the checkpoint after ``step`` steps lives."""
    return Path(folder) / f"step_{step:06d}"


def checkpoints(folder) -> list[tuple[int, Path]]:
    """Every complete checkpoint ``folder/step_NNNNNN`` as (step, path), oldest first ([] without the folder). Temp
    folders of a save that has not finished (``.tmp-*``) never match."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _STEP.fullmatch(p.name)))


def latest(folder) -> Path | None:
    """The newest complete checkpoint ``folder/step_NNNNNN`` (highest step), or None."""
    found = checkpoints(folder)
    return found[-1][1] if found else None


# ------------------------------------------------------------------------------ random generators

@reference_for("09-resume")
def rng_state() -> dict:
    """This process's generators: torch CPU, CUDA (every device, if any), Python ``random``, numpy."""
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@reference_for("09-resume")
def set_rng_state(state: dict) -> None:
    """The inverse of `rng_state` (CUDA states only where this process has as many GPUs)."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def reseed(seed: int, step: int, rank: int) -> int:
    """Seed every generator from (seed, step, rank) alone; returns the seed used. What a resume on another
    world size does: deterministic, different per rank and per resume step, but not the uninterrupted stream."""
    import numpy as np

    s = ((seed * 1_000_003 + step) * 1_009 + rank) % 2 ** 63
    torch.manual_seed(s)                              # also every CUDA device
    random.seed(s)
    np.random.seed(s % 2 ** 32)
    return s


def _save_rng(folder: Path, rank: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), folder / f"rng_rank{rank}.pt")


def _restore_rng(folder: Path, meta: dict) -> bool:
    """Continue this rank's streams from the checkpoint if the world size is the same, else `reseed`."""
    rank, world = _rank_world()
    file = folder / f"rng_rank{rank}.pt"
    if meta["world_size"] == world and file.exists():
        set_rng_state(torch.load(file, weights_only=False))
        return True
    reseed(meta["seed"], meta["step"], rank)
    if rank == 0:
        print(f"[dist_checkpoint] saved on {meta['world_size']} ranks, loaded on {world}: the random streams "
              f"cannot continue exactly; reseeded from (seed={meta['seed']}, step={meta['step']}, rank)", flush=True)
    return False


# ------------------------------------------------------------------------------ atomic folders

def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)


def _publish(tmp: Path, final: Path) -> None:
    """Rank 0: rename the finished temp folder to its final name (replacing an older copy of the same step)."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        _remove(old)
        final.rename(old)
        tmp.rename(final)
        _remove(old)
    else:
        tmp.rename(final)
    fd = os.open(final.parent, os.O_RDONLY)           # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare(final: Path, rank: int) -> Path:
    """Every rank: the temp folder to write into, emptied of a crashed save's leftovers by rank 0."""
    tmp = final.with_name(f".tmp-{final.name}")
    if rank == 0:
        _remove(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    return tmp


def _meta(step: int, data_position: int, seed: int, world: int, extra: dict | None) -> dict:
    return {"step": int(step), "data_position": int(data_position), "seed": int(seed), "world_size": world,
            "extra": dict(extra or {})}


# ------------------------------------------------------------------------------ DCP: plain, DDP, FSDP2

class AsyncCheckpoint:
    """The handle of an async save. ``result()`` (collective: every rank calls it, before the next save)
    waits for the write, publishes the folder (rank 0 renames it) and returns its final path."""

    def __init__(self, future, tmp: Path, final: Path, group, own_group: bool):
        self.future, self.tmp, self.final, self.group, self.own_group = future, tmp, final, group, own_group
        self._path: Path | None = None

    def result(self) -> Path:
        if self._path is None:
            self.future.result()
            _barrier(self.group)
            if _rank_world()[0] == 0:
                _publish(self.tmp, self.final)
            _barrier(self.group)
            if self.own_group:
                dist.destroy_process_group(self.group)
            self._path = self.final
        return self._path


def _state_dicts(model, optimizer, for_load: bool = False) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts as DCP sees them: ``get_state_dict``, or, for an optimizer
    that describes its own shards (``dcp_state_dict``) or a sharded module (``model.shards``), their own."""
    shards = getattr(model, "shards", None)
    if hasattr(optimizer, "dcp_state_dict"):
        optim_sd = optimizer.dcp_state_dict(model, for_load)
    elif shards is not None:
        optim_sd = shards.optimizer_dcp_state_dict(optimizer, for_load)
    else:
        return get_state_dict(model, optimizer)
    return (shards.dcp_state_dict(for_load) if shards is not None else get_model_state_dict(model)), optim_sd


@reference_for("09-resume")
def save(path, *, model, optimizer, scheduler=None, step: int, data_position: int, extra: dict | None = None,
         seed: int = 0, async_save: bool = False, process_group=None) -> AsyncCheckpoint | None:
    """Save model, optimizer, schedule, step, data position and every rank's RNG state to ``path`` (a folder,
    usually ``step_path(folder, step)``). Collective: every rank calls it. ``extra``: JSON-serializable.

    Synchronous: returns None once the checkpoint is published. ``async_save=True``: returns an
    `AsyncCheckpoint` as soon as the state is staged in CPU memory; the write runs in a thread on
    ``process_group`` (a gloo group; None: a new one for this save)."""
    final = Path(path)
    rank, world = _rank_world()
    meta = json.dumps(_meta(step, data_position, seed, world, extra))     # fails before anything is written
    tmp = _prepare(final, rank)
    _save_rng(tmp, rank)                              # this rank's streams, as they are now
    model_sd, optim_sd = _state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "train_state": meta}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if not async_save:
        dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())
        _barrier()                                    # every rank has written its part
        if rank == 0:
            _publish(tmp, final)
        _barrier()                                    # every rank now sees the final folder
        return None
    own = process_group is None and _distributed()
    group = dist.new_group(backend="gloo") if own else process_group
    future = dcp.async_save(state, checkpoint_id=tmp, process_group=group)
    return AsyncCheckpoint(future, tmp, final, group, own)


@reference_for("09-resume")
def load(path, *, model, optimizer, scheduler=None) -> TrainState:
    """Load a checkpoint written by `save` into ``model`` / ``optimizer`` / ``scheduler`` (built as for
    training: plain, DDP or FSDP2, on any world size) and restore this rank's RNG state; returns where the run
    stands. Collective: every rank calls it."""
    path = Path(path)
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    has_sched = any(k.startswith("scheduler.") for k in keys)
    if scheduler is not None and not has_sched:
        raise ValueError(f"{path} holds no learning-rate schedule: pass scheduler=None, or save one with it")
    model_sd, optim_sd = _state_dicts(model, optimizer, for_load=True)   # the layout this rank wants: DCP fills it
    state = {"model": model_sd, "optim": optim_sd, "train_state": ""}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
    shards = getattr(model, "shards", None)
    if shards is not None:
        shards.load_dcp_state_dict(state["model"])
    if hasattr(optimizer, "load_dcp_state_dict"):
        if shards is None:
            set_model_state_dict(model, state["model"])
        optimizer.load_dcp_state_dict(state["optim"], model)
    elif shards is not None:
        shards.load_optimizer_dcp_state_dict(optimizer, state["optim"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    meta = json.loads(state["train_state"])
    restored = _restore_rng(path, meta)
    return TrainState(meta["step"], meta["data_position"], meta["seed"], meta["world_size"], restored,
                      meta["extra"], path)


# ------------------------------------------------------------------------------ DeepSpeed

def save_deepspeed(engine, folder, step: int, data_position: int, *, seed: int = 0,
                   extra: dict | None = None) -> Path:
    """``engine.save_checkpoint`` into ``step_path(folder, step)``, atomically, with the train state in its
    ``client_state`` and every rank's RNG state in ``rng_rank{R}.pt`` (DeepSpeed saves the schedule it was
    given). Collective; returns the final path."""
    folder, (rank, world) = Path(folder), _rank_world()
    final = step_path(folder, step)
    tmp = _prepare(final, rank)
    _save_rng(tmp, rank)                              # this rank's streams, as they are now
    meta = _meta(step, data_position, seed, world, extra)
    engine.save_checkpoint(str(folder), tag=tmp.name, client_state={"train_state": meta}, save_latest=False)
    _barrier()
    if rank == 0:
        _publish(tmp, final)
    _barrier()
    return final


def load_deepspeed(engine, folder, tag: str | None = None) -> TrainState | None:
    """Load ``folder/tag`` (default: `latest`) into ``engine`` (optimizer and schedule included) and restore
    this rank's RNG state; None when there is no checkpoint. DeepSpeed's ZeRO-1/2 files are per rank: the
    world size must match (DeepSpeed's universal checkpoints convert them)."""
    path = Path(folder) / tag if tag else latest(folder)
    if path is None:
        return None
    loaded, client = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                            load_lr_scheduler_states=True)
    if loaded is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint in {path}")
    meta = client["train_state"]
    restored = _restore_rng(path, meta)
    return TrainState(meta["step"], meta["data_position"], meta["seed"], meta["world_size"], restored,
                      meta["extra"], path)
