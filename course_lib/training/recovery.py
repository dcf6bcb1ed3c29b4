"""Recovering from a loss spike as large runs did (lesson 09, second part), for the training script
(`course_lib.training.train`).

`SpikeWatch` runs the z-score detectors of ``[spikes]`` (`course_lib.training.spikes`) on the all-reduced loss and gradient
norm, so every rank takes the same decision. `recover` does PaLM's recovery (Chowdhery et al. 2022, section 5.1: "we
re-started training from a checkpoint roughly 100 steps before the spike started, and skipped roughly 200-500 data
batches"): load the newest checkpoint before the spike, move the data loader past the batches read since, optionally
lower the learning rate, and write that checkpoint again with the new position. `save_state` / `restore_state` put the
loader's position, the rewinds so far and the detectors' windows into a checkpoint's extras and back.
"""

from __future__ import annotations

from pathlib import Path

from course_lib.parallel import dist_checkpoint

__all__ = ["SpikeWatch", "json_number", "rewind_target", "drop_newer", "save_state", "restore_state", "recover"]


class SpikeWatch:
    """The two detectors of ``[spikes]`` (`spikes.SpikeDetector`), on the loss and on the gradient norm: a step is a
    spike when either value is. Both are fed the values all-reduced over the ranks, the same on every rank, so every
    rank takes the same decision with no extra collective."""

    def __init__(self, cfg):
        from course_lib.training.spikes import SpikeDetector

        s = cfg.spikes
        self.detectors = {m: SpikeDetector(s.window, s.warmup, s.z) for m in ("loss", "grad_norm")}

    def judge(self, step: int, position: int, values: dict) -> dict | None:
        """The spike event of this step, or None."""
        hit = {m: d.update(values[m]) for m, d in self.detectors.items()}
        if not any(hit.values()):
            return None
        event = {"step": step, "data_position": position, "metric": "+".join(m for m, h in hit.items() if h)}
        for m, d in self.detectors.items():
            event[m], event[f"z_{m}"] = values[m], json_number(d.last_z)
        return event

    def state_dict(self) -> dict:
        return {m: d.state_dict() for m, d in self.detectors.items()}

    def load_state_dict(self, state: dict) -> None:
        for m, d in self.detectors.items():
            d.load_state_dict(state[m])


def json_number(x: float):
    """A float for JSON: inf and nan as strings (json.dumps would write Infinity, which is not JSON)."""
    import math
    return x if math.isfinite(x) else str(x)


def rewind_target(folder: Path, last_step: int) -> Path | None:
    """The newest complete checkpoint in ``folder`` taken after at most ``last_step`` steps."""
    found = [p for step, p in dist_checkpoint.checkpoints(folder) if step <= last_step]
    return found[-1] if found else None


def drop_newer(folder: Path, step: int) -> None:
    """Delete the checkpoints taken after ``step`` (rank 0): they belong to the history a rewind threw away, and a
    restarted job must not resume from them."""
    import shutil

    for s, p in dist_checkpoint.checkpoints(folder):
        if s > step:
            shutil.rmtree(p, ignore_errors=True)


def save_state(engine, ckpt: Path, step: int, loader, watch, rewinds: int) -> None:
    """The checkpoint after ``step`` steps: the engine's state, and in its extras what `restore_state` puts back (the
    loader's position, the rewinds so far, the detectors' windows)."""
    extra = {"data": loader.state_dict(), "rewinds": rewinds,
             "spikes": watch.state_dict() if watch is not None else None}
    engine.save(ckpt, step, loader.position, extra)


def restore_state(state, loader, watch) -> None:
    """After loading a checkpoint: the loader's position and the detectors' windows as they were when it was taken
    (a checkpoint without a loader state, written before the loader had one: its data position)."""
    data = state.extra.get("data")
    if data is not None:
        loader.load_state_dict(data)
    else:
        loader.skip(state.data_position - loader.position)
    if watch is not None and state.extra.get("spikes"):
        watch.load_state_dict(state.extra["spikes"])


def recover(cfg, engine, loader, watch, ckpt: Path, event: dict, rewinds: int, rank: int, record: dict,
             loss: float) -> int | None:
    """PaLM's recovery from a spike at ``event['step']``: load the newest checkpoint at least
    ``spikes.min_steps_back`` steps before it, move the loader past every batch read since that checkpoint and
    ``spikes.skip_batches`` more, scale the learning rate by ``spikes.lr_factor``, and save that checkpoint again with
    the new position (a restart resumes past the skipped batches). Every rank calls it (the decision
    is the same on all). Returns the step to continue from, or None (no rewind: detect only, no checkpoint, or
    ``spikes.max_rewinds`` reached); the event goes into ``record['spikes']`` either way."""
    import torch.distributed as dist

    s, step = cfg.spikes, event["step"]
    target = rewind_target(ckpt, step - s.min_steps_back) if s.rewind and rewinds < s.max_rewinds else None
    print(f"[spike] step {step}: loss {loss:.4f} (z = {event['z_loss']}), grad norm {event['grad_norm']:.3g} "
          f"(z = {event['z_grad_norm']}) at data position {event['data_position']}", flush=True)
    if target is None:
        why = ("spikes.rewind = false" if not s.rewind else f"spikes.max_rewinds = {s.max_rewinds} reached"
               if rewinds >= s.max_rewinds else "no checkpoint before it")
        event.update(rewound_to=None, batches_skipped=[], note=why)
        print(f"[spike] not rewound: {why}", flush=True)
        if rank == 0:
            record["spikes"].append(event)
        return None
    dist.barrier()                                      # every rank has its verdict before files go away
    state = engine.load(target)
    restore_state(state, loader, watch)
    first = loader.position
    loader.skip(event["data_position"] + 1 + s.skip_batches - first)
    if s.lr_factor != 1.0:
        engine.scale_lr(s.lr_factor)
    dist.barrier()
    event.update(rewound_to=state.step, batches_skipped=[first, loader.position],
                 lr=engine.lr(), rewind=rewinds + 1)
    print(f"[spike] rewound to the checkpoint of step {state.step}, skipped batches {first}..{loader.position - 1} "
          f"({loader.position - first}), learning rate now {engine.lr():.3g}", flush=True)
    if rank == 0:
        drop_newer(ckpt, state.step)
        event["discarded_losses"] = {k: record["losses"].pop(k) for k in list(record["losses"])
                                     if int(k) >= state.step}
        event["discarded_losses"][str(step)] = json_number(loss)
        for k in [k for k in record["data_positions"] if int(k) >= state.step]:
            del record["data_positions"][k]
        record["spikes"].append(event)
    # The decision goes to disk at once: the checkpoint of step s written again, now with the loader past the skipped
    # batches and the rewind counted. A job restarted before the next checkpoint then resumes exactly where this
    # process goes on (a fresh process that loads it continues bit-exactly as this one: tests/test_train_faults.py),
    # instead of reading the bad batches again with its rewinds forgotten.
    save_state(engine, ckpt, state.step, loader, watch, rewinds + 1)
    return state.step
