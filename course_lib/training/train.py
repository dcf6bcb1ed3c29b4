"""The course's training script: a run as a team would operate it (lesson 09).

    torchrun --nproc-per-node 2 -m course_lib.training --config configs/tiny_ddp.toml
    python -m course_lib.training --config configs/tiny_ddp.toml --check --nprocs 2       # validate only
    launch(configs/tiny_ddp.toml, nprocs=2)                                               # from a notebook

One loop, whatever the engine: each step takes this rank's micro-batches of the global batch (gradient
accumulation), averages gradients over the data-parallel ranks (PyTorch DDP, FSDP2 or DeepSpeed ZeRO, as the
TOML config says: `course_lib.training.config`), clips the global gradient norm across shards
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
- a loss spike: ``[spikes]`` runs a z-score detector (`course_lib.training.spikes`) on the loss and the gradient norm, both
  all-reduced (the same numbers, hence the same decision, on every rank); on a spike the run goes back to the newest
  checkpoint at least ``min_steps_back`` steps before it, skips the batches read since that checkpoint (and
  ``skip_batches`` more), optionally lowers the learning rate (PaLM, Chowdhery et al. 2022, section 5.1), and records
  it under ``spikes`` in the record (`course_lib.training.recovery`);
- a hang: each rank writes a heartbeat (`course_lib.training.watchdog`) and `launch` watches them: a rank silent for
  ``watchdog.timeout_s`` is named and stopped, and with ``max_restarts`` the job resumes from its checkpoint.

    python -m course_lib.training --config configs/tiny_spike.toml --nprocs 2                     # launches torchrun
    python -m course_lib.training --config configs/tiny_hang.toml --nprocs 2 --max-restarts 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

__all__ = ["main", "train", "launch", "check"]


def _restart_count() -> int:
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


def _build_model(cfg, device):
    """The plain model (same weights on every rank: built from the job's seed) and its loss(x, y)."""
    from course_lib.model import build_model, hf_gpt2_config, lm_loss

    mcfg = cfg.model.config()
    if cfg.model.family == "course-gpt":
        model = build_model(mcfg, cfg.job.seed)
        if cfg.model.activation_checkpointing:
            from course_lib.parallel.checkpointing import apply_activation_checkpointing
            apply_activation_checkpointing(model)
        blocks = list(model.blocks)
    else:
        from transformers import GPT2LMHeadModel

        torch.manual_seed(cfg.job.seed)
        model = GPT2LMHeadModel(hf_gpt2_config(mcfg))
        if cfg.model.activation_checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model.loss = lambda x, y: lm_loss(model(x).logits, y)
        blocks = list(model.transformer.h)
    return model.to(device), blocks


def _optimizer(cfg, params):
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


def _scheduler(cfg, optimizer):
    from course_lib.parallel import schedules

    s = cfg.schedule
    if s.name == "warmup_cosine":
        return schedules.warmup_cosine_scheduler(optimizer, peak_lr=cfg.optimizer.lr, warmup_steps=s.warmup_steps,
                                                 total_steps=s.steps, min_lr=s.min_lr)
    if s.name == "warmup_constant":
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: schedules.warmup_constant(step, 1.0, s.warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


class LossOf(torch.nn.Module):
    """``LossOf(model)(x, y) == model.loss(x, y)`` through ``__call__``: DDP's hooks see the whole forward.
    ``summed=True``: the summed loss over the valid targets instead (`token_loss.loss_sum_and_tokens`)."""

    def __init__(self, model, summed: bool = False):
        super().__init__()
        self.model, self.summed = model, summed

    def forward(self, x, y):
        if not self.summed:
            return self.model.loss(x, y)
        from course_lib.training.token_loss import loss_sum_and_tokens

        out = self.model(x)
        return loss_sum_and_tokens(getattr(out, "logits", out), y)[0]       # (B, T, V) vs (B, T) -> ()


class Engine:
    """What the loop needs from PyTorch DDP, FSDP2 or DeepSpeed: forward/backward of a micro-batch, the global
    gradient norm (clipping it), the optimizer step, the current lr, and checkpoint save/load."""

    def __init__(self, cfg, layout: dict, device):
        import torch.distributed as dist
        import torch.nn as nn

        self.cfg, self.kind, self.device = cfg, cfg.parallelism.engine, device
        model, blocks = _build_model(cfg, device)
        self.model, self.ds_engine, self.scheduler = model, None, None
        self.accum, self.dp = layout["accum"], layout["dp"]
        self.summed = cfg.data.loss == "global_tokens"
        if self.kind == "deepspeed":
            self._init_deepspeed(model, layout)
            return
        if self.kind == "ddp":
            self.net = nn.parallel.DistributedDataParallel(LossOf(model, self.summed)) \
                if dist.get_world_size() > 1 else LossOf(model, self.summed)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (layout["dp"],))
            for block in blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.net = LossOf(model, self.summed)
        self.optimizer = _optimizer(cfg, model.parameters())
        self.scheduler = _scheduler(cfg, self.optimizer)
        self._no_sync = getattr(self.net, "no_sync", None)

    def _init_deepspeed(self, model, layout: dict) -> None:
        from course_lib.parallel.deepspeed_config import import_deepspeed

        deepspeed = import_deepspeed()
        conf = deepspeed_settings(self.cfg, layout)
        opt = None if "optimizer" in conf else _optimizer(self.cfg, model.parameters())
        sched = None if "scheduler" in conf or opt is None else _scheduler(self.cfg, opt)
        self.ds_engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=LossOf(model, self.summed), model_parameters=model.parameters(), optimizer=opt, lr_scheduler=sched,
            config=conf)

    def loss(self, x, y, last_micro: bool, n_global=None):
        """Forward and backward of one micro-batch; DDP's all-reduce only after the last one. Returns the
        micro-batch's summed loss (``data.loss = 'global_tokens'``: back-propagated as loss_sum x dp / N, N the
        step's valid tokens over every micro-batch and rank, as the engines average gradients over the dp ranks:
        `token_loss.token_normalized`) or its mean (``'micro_batch_mean'``: mean / micro-batches)."""
        from course_lib.training.token_loss import token_normalized

        def scaled(loss):
            return token_normalized(loss, n_global, grad_divisor=self.dp) if self.summed else loss / self.accum

        if self.ds_engine is not None:
            loss = self.ds_engine(x, y)
            self.ds_engine.backward(scaled(loss) * self.accum)   # DeepSpeed divides by gradient_accumulation_steps
            self.ds_engine.step()                        # DeepSpeed steps its optimizer on the last micro-batch
            return loss
        quiet = self._no_sync is not None and not last_micro
        with self._no_sync() if quiet else contextlib.nullcontext():
            loss = self.net(x, y)
            scaled(loss).backward()
        return loss

    def step(self, lr_multiplier: float = 1.0) -> float:
        """Clip, step; returns the global gradient norm before clipping. ``lr_multiplier``: this one update uses
        the learning rate times it (``[fault] kind = "lr_jump"``; the schedule sets the next step's rate anew)."""
        if self.ds_engine is not None:                   # the step happened with the last micro-batch
            norm = self.ds_engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        from course_lib.parallel import clipping

        max_norm = self.cfg.clipping.max_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = clipping.clip_model_grad_norm_(params, max_norm) if max_norm > 0 else \
            clipping.model_grad_norm(params)
        if lr_multiplier != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] *= lr_multiplier
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return float(norm)

    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        if self.ds_engine is not None:
            return float(self.ds_engine.get_lr()[0])
        return float(self.optimizer.param_groups[0]["lr"])

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate from now on (the schedule's base rates too: saved with the scheduler)."""
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] *= factor

    def save(self, folder: Path, step: int, data_position: int, extra: dict) -> None:
        from course_lib.parallel import dist_checkpoint as dcp
        if self.ds_engine is not None:
            dcp.save_deepspeed(self.ds_engine, folder, step=step, data_position=data_position,
                               seed=self.cfg.job.seed, extra=extra)
        else:
            dcp.save(dcp.step_path(folder, step), model=self.model, optimizer=self.optimizer,
                     scheduler=self.scheduler, step=step, data_position=data_position, seed=self.cfg.job.seed,
                     extra=extra)

    def load(self, path: Path):
        """Load one checkpoint (DDP, FSDP2); its `dist_checkpoint.TrainState`."""
        from course_lib.parallel import dist_checkpoint as dcp
        return dcp.load(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)

    def resume(self, folder: Path):
        """Load the newest checkpoint in ``folder``: its `dist_checkpoint.TrainState`, or None where there is none."""
        from course_lib.parallel import dist_checkpoint as dcp
        if self.ds_engine is not None:
            return dcp.load_deepspeed(self.ds_engine, folder)
        path = dcp.latest(folder)
        return self.load(path) if path is not None else None


def deepspeed_settings(cfg, layout: dict) -> dict:
    """The [deepspeed] JSON as written, checked against the run and adapted only where this machine needs it.

    Batch sizes must agree with [data] (DeepSpeed itself requires train_batch_size = micro x accumulation x dp).
    On a CPU: fp16 becomes bf16 where DeepSpeed refuses fp16 (no AVX512-FP16: `hardware.cpu_features`), and its
    AdamW is torch's (``torch_adam``): DeepSpeed's fused Adam is a compiled GPU kernel."""
    from course_lib.config import ConfigError
    from course_lib.parallel.deepspeed_config import deepspeed_accepts_fp16

    conf = json.loads(json.dumps(cfg.deepspeed))
    want = {"train_batch_size": cfg.data.global_batch, "train_micro_batch_size_per_gpu": cfg.data.micro_batch,
            "gradient_accumulation_steps": layout["accum"]}
    for key, value in want.items():
        if key in conf and conf[key] != value:
            raise ConfigError(f"{cfg.source}: deepspeed.{key} = {conf[key]} but [data] gives {value} on "
                              f"{layout['dp']} data-parallel ranks: make them agree (or drop the key)")
        conf[key] = value
    conf.setdefault("gradient_clipping", cfg.clipping.max_norm)
    conf.setdefault("steps_per_print", 10 ** 9)
    if not torch.cuda.is_available():
        if conf.get("fp16", {}).get("enabled") and not deepspeed_accepts_fp16():
            print("[deepspeed] fp16 -> bf16: DeepSpeed refuses fp16 on this CPU (no native fp16 kernels)")
            conf["fp16"] = {"enabled": False}
            conf["bf16"] = {"enabled": True}
        if conf.get("optimizer", {}).get("type", "").lower() in ("adam", "adamw"):
            conf["optimizer"].setdefault("params", {})["torch_adam"] = True
        conf.setdefault("zero_allow_untested_optimizer", True)
        conf.setdefault("zero_force_ds_cpu_optimizer", False)
    return conf


def inject_fault(cfg, rank: int, step: int) -> None:
    """The configured fault, on its rank at its step, on the first attempt only (a restarted job runs clean)."""
    f = cfg.fault
    if not f.kind or rank != f.rank or _restart_count() > 0:
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
    failures += [start * step_clock if step_clock else time.time()] * max(0, _restart_count() - len(failures))
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
        if cfg.fault.kind == "spike" and position == cfg.fault.step and _restart_count() == 0:
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
        jump = cfg.fault.kind == "lr_jump" and step == cfg.fault.step and not jumped and _restart_count() == 0
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
    if rank == 0:
        record.update(config=cfg.to_dict(), world_size=world, layout=layout, restarts=_restart_count(),
                      final_params=_params_digest(engine), eval_loss=_eval_loss(cfg, engine, loader.tokens, device))
        (out / "result.json").write_text(json.dumps(record, indent=1))
    else:
        _params_digest(engine)                          # a collective under FSDP2: every rank takes part
        _eval_loss(cfg, engine, loader.tokens, device)
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


def check(config: str | Path, nprocs: int, overrides: dict | None = None):
    """Load and validate a config for ``nprocs`` ranks, in this process: a bad config fails here, naming the
    field, before any rank starts. Returns (config, layout)."""
    from course_lib.training.config import load_config, validate_world

    cfg = load_config(config, overrides)
    layout = validate_world(cfg, nprocs)
    if cfg.parallelism.engine == "deepspeed":
        deepspeed_settings(cfg, layout)
    from course_lib.config import ConfigError
    if cfg.fault.kind and cfg.fault.rank >= nprocs:
        raise ConfigError(f"{cfg.source}: fault.rank: {cfg.fault.rank} but the run has {nprocs} ranks")
    if cfg.fault.kind == "lr_jump" and cfg.parallelism.engine == "deepspeed":
        raise ConfigError(f"{cfg.source}: fault.kind: 'lr_jump' changes the learning rate of one update of a DDP or "
                          f"FSDP2 run; DeepSpeed steps inside its engine: use engine 'ddp' or 'fsdp2'")
    return cfg, layout


def launch(config: str | Path, nprocs: int, overrides: dict | None = None, *, max_restarts: int = 0,
           timeout_s: float = 600.0, stream: bool = True, on_poll=None):
    """Validate, then run ``python -m course_lib.training --config CONFIG`` under torchrun on ``nprocs`` ranks (from a
    notebook or a test). Returns (`launch.RunResult`, the record rank 0 wrote). ``on_poll`` as in
    `launch.run_script` (lesson 09 follows the metrics file with it).

    With ``watchdog.timeout_s`` set, this process watches the ranks' heartbeats (`course_lib.training.watchdog`) every
    ``watchdog.poll_s``: a rank silent for longer is named (rank, step, seconds: printed, and in the record under
    ``hangs``) and stopped with SIGABRT (its Python stack goes to its log); torchrun then stops the others and, while
    ``max_restarts`` allows, starts them all again from the newest checkpoint. With no restart left the run fails
    with `watchdog.HangError` naming the rank; no process is left behind (`launch.run_script` kills the tree)."""
    from course_lib.runtime import launch as launcher
    from course_lib.training.watchdog import HangError, Watchdog

    cfg, _ = check(config, nprocs, overrides)
    args = ["--config", str(config)] + [f"--set={k}={json.dumps(v)}" for k, v in (overrides or {}).items()]
    hangs: list[dict] = []
    poll = on_poll
    if cfg.watchdog.timeout_s:
        import shutil

        shutil.rmtree(cfg.out_dir / "heartbeat", ignore_errors=True)   # an earlier run's beats are not this one's
        dog = Watchdog(cfg.out_dir / "heartbeat", nprocs, cfg.watchdog.timeout_s)
        due = [0.0]

        def poll() -> None:
            if on_poll is not None:
                on_poll()
            if time.monotonic() < due[0]:
                return
            due[0] = time.monotonic() + cfg.watchdog.poll_s
            stall = dog.poll()
            if stall is None:
                return
            print(f"{stall}; stopping rank {stall.rank} (SIGABRT: its stack goes to its log)"
                  + ("; torchrun restarts the job from its checkpoint" if len(hangs) < max_restarts else ""),
                  flush=True)
            hangs.append(stall.to_dict())
            if stall.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stall.pid, signal.SIGABRT)

    try:
        result = launcher.run_script(Path(__file__), nprocs, args, timeout_s=timeout_s, stream=stream,
                                     max_restarts=max_restarts, on_poll=poll)
    except launcher.DistributedRunError as exc:
        if not hangs:
            raise
        raise HangError(hangs[-1], exc) from None
    record = json.loads((cfg.out_dir / "result.json").read_text())
    if cfg.watchdog.timeout_s:
        record["hangs"] = hangs
        (cfg.out_dir / "result.json").write_text(json.dumps(record, indent=1))
    return result, record


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.training", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a TOML run config, e.g. configs/tiny_ddp.toml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a field (value in JSON: 40, 1e-3, true, \"ddp\")")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="the number of ranks: with --check, to validate for; else, outside torchrun, start "
                             "torchrun on that many ranks (with the watchdog of [watchdog])")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="with --nprocs: how often torchrun starts every rank again after one failed or hung")
    args = parser.parse_args(argv)
    from course_lib.config import ConfigError

    world = args.nprocs or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg, layout = check(args.config, world, _overrides(args.set))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{cfg.source}: valid for {world} ranks: {layout}")
        return 0
    if args.nprocs and "RANK" not in os.environ:         # the launching process: torchrun under our watchdog
        return _launch_from_command_line(args, _overrides(args.set))
    import torch.distributed as dist

    from course_lib import dist as cdist

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        # torchrun keeps one store across restarts: the keys of an attempt's process group must not meet the keys
        # of the attempt before it (a rank would read a dead peer's address and fail to connect), so each
        # attempt's keys get their own prefix.
        store, rank, size = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"course-train/attempt-{_restart_count()}", store)
        dist.init_process_group(cdist.pick_backend(world, announce=False), store=store, rank=rank, world_size=size)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        train(cfg, layout)
    finally:
        dist.destroy_process_group()
    return 0


def _launch_from_command_line(args, overrides: dict) -> int:
    """``python -m course_lib.training --config X --nprocs N [--max-restarts R]``: `launch` from a shell."""
    from course_lib.runtime import launch as launcher
    from course_lib.dist import pick_backend
    from course_lib.measure.hardware import hardware_label
    from course_lib.training.watchdog import HangError

    print(f"[train] {args.nprocs} ranks, {hardware_label(pick_backend(args.nprocs, announce=False))}", flush=True)
    try:
        result, record = launch(args.config, args.nprocs, overrides, max_restarts=args.max_restarts)
    except (launcher.DistributedRunError, HangError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    last = max(record["losses"], key=int)
    print(f"[train] done: step {last} loss {record['losses'][last]:.4f}; restarts {record['restarts']} (resumed "
          f"from {record['resumed_from']}); spikes {[e['step'] for e in record['spikes']]}; hangs "
          f"{[(h['rank'], h['step']) for h in record.get('hangs', [])]}; wall {result.wall_s:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
