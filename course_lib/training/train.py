"""The training loop of the course's training script (lesson 09): a run as a team would operate it.

    record = train(cfg, layout)        # on every rank, in its process group (`command.main` sets it up)

`course_lib.training.command` is the script's command line and its launch under torchrun; `train` is what every rank
runs. One loop, whatever the engine (`course_lib.training.engine`): each step takes this rank's micro-batches of the
global batch (gradient accumulation), averages gradients over the data-parallel ranks (PyTorch DDP, FSDP2 or
DeepSpeed ZeRO, as the TOML config says: `course_lib.training.config`), clips the global gradient norm across shards
(`parallel.clipping`), steps the optimizer and the learning-rate schedule (`parallel.schedules`), writes the
step's metrics to TensorBoard and a JSON-lines stream (`course_lib.training.monitor`), evaluates the alert rules on them
(`course_lib.training.alerts`), and every ``checkpoint.interval`` steps saves a distributed checkpoint
(`parallel.dist_checkpoint`, DeepSpeed's own with engine 'deepspeed'). A run started again, by hand or by
``torchrun --max-restarts`` after a rank died, resumes from the newest checkpoint and continues bit-exactly.

Rank 0 writes ``OUT/result.json``: the config, the loss of every step, the steps it resumed from, the alerts that
fired and the time each step took.

Data: `course_lib.data.WindowLoader`, a shuffling loader over a finite dataset of token windows whose position
(epoch, batch) goes into every checkpoint: a resumed run reads on where the checkpoint stopped, which is not its step
once batches were skipped. The loss is the summed loss over the global number of valid tokens of the step (every
micro-batch of every rank: `course_lib.training.token_loss`, torchtitan's PR 2206), right with padded sequences too
(``data.pad_fraction``).

When a large run goes wrong (lesson 09, second part):
- a loss spike: ``[spikes]`` runs a z-score detector (`course_lib.training.spikes`) on the loss and the gradient
  norm, both all-reduced (the same numbers, hence the same decision, on every rank); on a spike the run goes back to
  the newest checkpoint at least ``min_steps_back`` steps before it, skips the batches read since that checkpoint
  (and ``skip_batches`` more), optionally lowers the learning rate (PaLM, Chowdhery et al. 2022, section 5.1), and
  records it under ``spikes`` in the record (`course_lib.training.recovery`);
- a hang: each rank writes a heartbeat (`course_lib.training.watchdog`) and `command.launch` watches them: a rank
  silent for ``watchdog.timeout_s`` is named and stopped, and with ``max_restarts`` the job resumes from its
  checkpoint;
- a fault on purpose: ``[fault]`` breaks a run at a chosen step (`inject_fault`: one rank killed, crashed, exited,
  raised, slow or hung, on the first attempt only; in the loop: a poisoned batch, a NaN loss, an lr jump).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from course_lib.training.engine import Engine

__all__ = ["train", "restart_count", "inject_fault", "memory_fraction"]


def restart_count() -> int:
    """Which attempt this process belongs to: 0 the first, n after torchrun's n-th restart of every rank."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _tokens(cfg, seed: int):
    """The run's token stream: the offline text corpus, or random tokens drawn from the seed."""
    from course_lib.data import text_corpus

    vocab = cfg.model.config().vocab_size
    if cfg.data.source == "corpus":
        return text_corpus(2_000_000).long() % vocab      # bytes (0-255) into the vocabulary
    return torch.randint(vocab, (1_000_000,), generator=torch.Generator().manual_seed(seed))


def _loader(cfg):
    from course_lib.data import WindowLoader

    return WindowLoader(_tokens(cfg, cfg.job.seed), cfg.model.config().seq_len, cfg.data.global_batch,
                        seed=cfg.job.seed, pad_fraction=cfg.data.pad_fraction)


def _poisoned(y, vocab: int):
    """``[fault] kind = "spike"``: a batch's targets scrambled, each byte b replaced by vocab - 1 - b (text's ASCII
    bytes become bytes that text never has; padding stays padding): bad data, as a corrupted shard gives."""
    return torch.where(y >= 0, vocab - 1 - y, y)



def inject_fault(cfg, rank: int, step: int) -> None:
    """The configured fault, on its rank at its step, on the first attempt only (a restarted job runs clean)."""
    f = cfg.fault
    if not f.kind or rank != f.rank or restart_count() > 0:
        return
    if f.kind == "slow" and step >= f.step:
        time.sleep(f.seconds)                           # a straggler: every other rank waits for it
    if step != f.step:
        return
    sys.stdout.flush()
    if f.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)            # what the out-of-memory killer does
    elif f.kind == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)            # what a crash in C++ or CUDA looks like
    elif f.kind == "exit":
        os._exit(3)
    elif f.kind == "exception":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    elif f.kind == "hang":
        time.sleep(10 ** 6)


def memory_fraction(device) -> float:
    """Memory in use as a fraction of what this rank may use: the GPU's allocator peak over its memory, or on
    a CPU the process's resident memory over the machine's memory shared among its ranks."""
    import psutil

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / torch.cuda.get_device_properties(device).total_memory
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return psutil.Process().memory_info().rss / (psutil.virtual_memory().total / ranks)


def train(cfg, layout: dict) -> dict:
    """Run (or resume) the configured training on every rank; rank 0 returns and writes the run's record."""
    import torch.distributed as dist

    from course_lib.training import alerts, monitor, recovery
    from course_lib import dist as cdist
    from course_lib.training.token_loss import global_valid_tokens
    from course_lib.training.watchdog import Heartbeat

    rank, world, device = dist.get_rank(), dist.get_world_size(), cdist.device()
    out = cfg.out_dir
    ckpt = out / cfg.checkpoint.folder
    engine = Engine(cfg, layout, device)
    loader = _loader(cfg)
    watch = recovery.SpikeWatch(cfg) if cfg.spikes.detect else None
    beat = Heartbeat(out / "heartbeat", rank) if cfg.watchdog.timeout_s else (lambda step, phase="start": None)
    beat(-1, "start")
    state = engine.resume(ckpt) if cfg.checkpoint.interval else None
    start, rewinds = (state.step, state.extra.get("rewinds", 0)) if state is not None else (0, 0)
    if state is None:                                   # every generator (torch, random, numpy) from the seed and
        from course_lib.parallel.dist_checkpoint import reseed      # the rank: two runs of a config draw the same
        reseed(cfg.job.seed, 0, rank)                   # numbers, dropout masks differ per rank; a resume restores them
    else:
        recovery.restore_state(state, loader, watch)
    mcfg = cfg.model.config()
    dp_rank, dp, micro = rank // layout["tp"], layout["dp"], cfg.data.micro_batch
    summed = cfg.data.loss == "global_tokens"
    writer = monitor.MetricsWriter(out / "tb", enabled=rank == 0 and cfg.logging.tensorboard)
    rules = alerts.AlertEngine(cfg.logging.rules()) if rank == 0 and cfg.logging.alerts else None
    step_clock = cfg.logging.alert_seconds_per_step
    record = _previous_record(out) if rank == 0 and start else _new_record()
    if start:
        record["resumed_from"].append(start)
    failures = record.setdefault("failures", [])        # the alert clock at each restart: one failed rank each
    failures += [start * step_clock if step_clock else time.time()] * max(0, restart_count() - len(failures))
    flops_per_step = 6 * mcfg.num_params() * cfg.data.global_batch * mcfg.seq_len
    bar = _progress(rank, start, cfg.schedule.steps)
    jumped = False                                      # an lr_jump hits the first pass of its step only
    step = start
    while step < cfg.schedule.steps:
        beat(step, "start")
        t0 = time.perf_counter()
        lr = engine.lr()                                # the rate this step's update uses
        position = loader.position                      # the global batch this step reads
        x_all, y_all = loader.next(dp_rank, dp)
        if cfg.fault.kind == "spike" and position == cfg.fault.step and restart_count() == 0:
            y_all = _poisoned(y_all, mcfg.vocab_size)
        batches = [(x_all[m * micro:(m + 1) * micro].to(device), y_all[m * micro:(m + 1) * micro].to(device))
                   for m in range(layout["accum"])]
        n_global = global_valid_tokens([y for _, y in batches]) if summed else None    # one all-reduce
        losses = []
        for m, (x, y) in enumerate(batches):
            losses.append(engine.loss(x, y, last_micro=m == layout["accum"] - 1, n_global=n_global).detach())
            if cfg.fault.kind == "nan" and rank == cfg.fault.rank and step >= cfg.fault.step:
                losses[-1] = losses[-1] * float("inf")
        inject_fault(cfg, rank, step)
        jump = cfg.fault.kind == "lr_jump" and step == cfg.fault.step and not jumped and restart_count() == 0
        jumped = jumped or jump
        norm = engine.step(lr_multiplier=cfg.fault.factor if jump else 1.0)
        compute_s = time.perf_counter() - t0
        local = torch.stack(losses).sum() if summed else torch.stack(losses).mean()
        stats = torch.stack([local.double().reshape(()), torch.tensor(norm, dtype=torch.float64)]).to(device)
        beat(step, "sync")
        t_sync = time.perf_counter()
        dist.all_reduce(stats)                          # also where every rank waits for the slowest one
        sync_s = time.perf_counter() - t_sync
        step_s = time.perf_counter() - t0
        loss = float(stats[0]) / (float(n_global) if summed else world)
        event = watch.judge(step, position, {"loss": loss, "grad_norm": float(stats[1]) / world}) \
            if watch is not None else None
        if event is not None:
            back = recovery.recover(cfg, engine, loader, watch, ckpt, event, rewinds, rank, record, loss)
            if back is not None:                        # rewound: steps back..step are done again on new data
                rewinds += 1
                if rank == 0:
                    (out / "progress.json").write_text(json.dumps(record))
                step = back
                if bar is not None:
                    bar.n = back
                continue
        if (step + 1) % cfg.logging.interval == 0 or step == cfg.schedule.steps - 1:
            metrics = {"loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": cfg.data.global_batch *
                       mcfg.seq_len / step_s, "throughput": cfg.data.global_batch / step_s,
                       "step_s": step_s, "sync_time_s": sync_s, "comm_fraction": sync_s / step_s,
                       "achieved_flops": flops_per_step / step_s / world, "memory_fraction": memory_fraction(device),
                       "compute_s": compute_s}
            now = step * step_clock if step_clock else time.time()
            metrics["node_failure_rate"] = alerts.node_failure_rate(failures, now, world)   # in the last hour
            writer.write(step, metrics)
            if rules is not None:
                for alert in rules.observe(now, metrics):
                    print(f"[alert] step {step}: {alert}", flush=True)
                    record["alerts"].append({"step": step, "rule": alert.rule.name, "metric": alert.rule.metric,
                                             "text": str(alert)})
        if rank == 0:
            record["losses"][str(step)] = loss
            record["data_positions"][str(step)] = position
        if cfg.checkpoint.interval and (step + 1) % cfg.checkpoint.interval == 0:
            beat(step, "save")
            recovery.save_state(engine, ckpt, step + 1, loader, watch, rewinds)
            if rank == 0:                               # what a resumed run continues: losses and alerts so far
                (out / "progress.json").write_text(json.dumps(record))
                _keep_newest(ckpt, cfg.checkpoint.keep)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        step += 1
    writer.close()
    if bar is not None:
        bar.close()
    final = dict(final_params=_params_digest(engine),   # collectives under FSDP2: every rank takes part
                 eval_loss=_eval_loss(cfg, engine, loader.tokens, device), built=engine.describe(_probe(mcfg, device)))
    if rank == 0:
        record.update(config=cfg.to_dict(), world_size=world, layout=layout, restarts=restart_count(), **final)
        (out / "result.json").write_text(json.dumps(record, indent=1))
    return record


EVAL_BATCHES = 4


def _eval_loss(cfg, engine, tokens, device) -> float | None:
    """The final model's mean loss on ``EVAL_BATCHES`` fixed global batches (`data.get_batch` at steps 10^9 + i: the
    same windows for every run of a seed), so that two runs that read different data are compared on the same
    tokens. Every rank computes it (FSDP2's forward is collective). None under DeepSpeed (ZeRO-3 shards the model)."""
    from course_lib.data import get_batch
    from course_lib.model import lm_loss

    if engine.ds_engine is not None:
        return None
    T = cfg.model.config().seq_len
    total = 0.0
    with torch.no_grad():
        for i in range(EVAL_BATCHES):
            x, y = get_batch(tokens, cfg.data.global_batch, T, 10 ** 9 + i, seed=cfg.job.seed, device=device)
            out = engine.model(x)
            total += float(lm_loss(getattr(out, "logits", out), y))
    return total / EVAL_BATCHES


def _probe(mcfg, device):
    """One sequence of token 0 (1, T): the forward `Engine.describe` watches."""
    return torch.zeros(1, mcfg.seq_len, dtype=torch.long, device=device)


def _new_record() -> dict:
    return {"losses": {}, "alerts": [], "resumed_from": [], "spikes": [], "data_positions": {}}


def _keep_newest(folder: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (rank 0, after the save's closing barrier)."""
    import shutil

    from course_lib.parallel import dist_checkpoint

    for _, old in dist_checkpoint.checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _previous_record(out: Path) -> dict:
    """The record of the run that wrote the checkpoint we resume from (its losses, alerts, restarts)."""
    path = out / "progress.json"
    record = _new_record()
    if path.exists():
        record.update(json.loads(path.read_text()))
    return record


def _params_digest(engine) -> dict:
    """{name: sha256 of the full fp32 parameter} (FSDP2's shards gathered; DeepSpeed ZeRO-3 gathered)."""
    import hashlib

    model = engine.model
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = hashlib.sha256(full.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
    return out


def _progress(rank: int, start: int, total: int):
    if rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stdout, mininterval=1.0,
                dynamic_ncols=False, ncols=100)

