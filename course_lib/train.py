"""The course's training script: a run as a team would operate it (lesson 09).

    torchrun --nproc-per-node 2 -m course_lib.train --config configs/tiny_ddp.toml
    python -m course_lib.train --config configs/tiny_ddp.toml --check --nprocs 2       # validate only
    launch(configs/tiny_ddp.toml, nprocs=2)                                               # from a notebook

One loop, whatever the engine: each step takes this rank's micro-batches of the global batch (gradient
accumulation), averages gradients over the data-parallel ranks (PyTorch DDP, FSDP2 or DeepSpeed ZeRO, as the
TOML config says: `course_lib.train_config`), clips the global gradient norm across shards
(`parallel.clipping`), steps the optimizer and the learning-rate schedule (`parallel.schedules`), writes the
step's metrics to TensorBoard and a JSON-lines stream (`course_lib.monitor`), evaluates the alert rules on them
(`course_lib.alerts`), and every ``checkpoint.interval`` steps saves a distributed checkpoint
(`parallel.dist_checkpoint`, DeepSpeed's own with engine 'deepspeed'). A run started again, by hand or by
``torchrun --max-restarts`` after a rank died, resumes from the newest checkpoint and continues bit-exactly.

Rank 0 writes ``OUT/result.json``: the config, the loss of every step, the steps it resumed from, the alerts that
fired and the time each step took. Data: `course_lib.data.get_batch` draws step s's global batch from (seed, s)
alone, so the data position of a resumed run is its step.
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
    from course_lib.data import text_corpus

    vocab = cfg.model.config().vocab_size
    if cfg.data.source == "corpus":
        return text_corpus(2_000_000).long() % vocab      # bytes (0-255) into the vocabulary
    return torch.randint(vocab, (1_000_000,), generator=torch.Generator().manual_seed(seed))


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
    """``LossOf(model)(x, y) == model.loss(x, y)`` through ``__call__``: DDP's hooks see the whole forward."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model.loss(x, y)


class Engine:
    """What the loop needs from PyTorch DDP, FSDP2 or DeepSpeed: forward/backward of a micro-batch, the global
    gradient norm (clipping it), the optimizer step, the current lr, and checkpoint save/load."""

    def __init__(self, cfg, layout: dict, device):
        import torch.distributed as dist
        import torch.nn as nn

        self.cfg, self.kind, self.device = cfg, cfg.parallelism.engine, device
        model, blocks = _build_model(cfg, device)
        self.model, self.ds_engine, self.scheduler = model, None, None
        if self.kind == "deepspeed":
            self._init_deepspeed(model, layout)
            return
        self.accum = layout["accum"]
        if self.kind == "ddp":
            self.net = nn.parallel.DistributedDataParallel(LossOf(model)) if dist.get_world_size() > 1 \
                else LossOf(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (layout["dp"],))
            for block in blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.net = LossOf(model)
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
            model=LossOf(model), model_parameters=model.parameters(), optimizer=opt, lr_scheduler=sched, config=conf)

    def loss(self, x, y, last_micro: bool):
        """Forward and backward of one micro-batch (gradients averaged over the micro-batches of a step; DDP's
        all-reduce only after the last one)."""
        if self.ds_engine is not None:
            loss = self.ds_engine(x, y)
            self.ds_engine.backward(loss)                # scaled by 1 / gradient_accumulation_steps
            self.ds_engine.step()                        # DeepSpeed steps its optimizer on the last micro-batch
            return loss
        quiet = self._no_sync is not None and not last_micro
        with self._no_sync() if quiet else contextlib.nullcontext():
            loss = self.net(x, y)
            (loss / self.accum).backward()
        return loss

    def step(self) -> float:
        """Clip, step; returns the global gradient norm before clipping."""
        if self.ds_engine is not None:                   # the step happened with the last micro-batch
            norm = self.ds_engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        from course_lib.parallel import clipping

        max_norm = self.cfg.clipping.max_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = clipping.clip_model_grad_norm_(params, max_norm) if max_norm > 0 else \
            clipping.model_grad_norm(params)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return float(norm)

    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        if self.ds_engine is not None:
            return float(self.ds_engine.get_lr()[0])
        return float(self.optimizer.param_groups[0]["lr"])

    def save(self, folder: Path, step: int) -> None:
        from course_lib.parallel import dist_checkpoint as dcp
        if self.ds_engine is not None:
            dcp.save_deepspeed(self.ds_engine, folder, step=step, data_position=step, seed=self.cfg.job.seed)
        else:
            dcp.save(dcp.step_path(folder, step), model=self.model, optimizer=self.optimizer,
                     scheduler=self.scheduler, step=step, data_position=step, seed=self.cfg.job.seed)

    def resume(self, folder: Path) -> int:
        """Load the newest checkpoint in ``folder``; the step to continue from (0: none)."""
        from course_lib.parallel import dist_checkpoint as dcp
        if self.ds_engine is not None:
            state = dcp.load_deepspeed(self.ds_engine, folder)
            return state.step if state is not None else 0
        path = dcp.latest(folder)
        if path is None:
            return 0
        return dcp.load(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler).step


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

    from course_lib import alerts, monitor
    from course_lib import dist as cdist
    from course_lib.data import get_batch

    rank, world, device = dist.get_rank(), dist.get_world_size(), cdist.device()
    out = cfg.out_dir
    ckpt = out / cfg.checkpoint.folder
    engine = Engine(cfg, layout, device)
    start = engine.resume(ckpt) if cfg.checkpoint.interval else 0
    if start == 0:
        torch.manual_seed(cfg.job.seed * 1000 + rank)   # dropout masks differ per rank; a resume restored its RNG
    tokens = _tokens(cfg, cfg.job.seed)
    mcfg = cfg.model.config()
    dp_rank, dp, micro = rank // layout["tp"], layout["dp"], cfg.data.micro_batch
    writer = monitor.MetricsWriter(out / "tb", enabled=rank == 0 and cfg.logging.tensorboard)
    rules = alerts.AlertEngine(cfg.logging.rules()) if rank == 0 and cfg.logging.alerts else None
    step_clock = cfg.logging.alert_seconds_per_step
    record = _previous_record(out) if rank == 0 and start else {"losses": {}, "alerts": [], "resumed_from": []}
    if start:
        record["resumed_from"].append(start)
    failures = record.setdefault("failures", [])        # the alert clock at each restart: one failed rank each
    failures += [start * step_clock if step_clock else time.time()] * max(0, _restart_count() - len(failures))
    flops_per_step = 6 * mcfg.num_params() * cfg.data.global_batch * mcfg.seq_len
    bar = _progress(rank, start, cfg.schedule.steps)
    for step in range(start, cfg.schedule.steps):
        t0 = time.perf_counter()
        lr = engine.lr()                                # the rate this step's update uses
        x_all, y_all = get_batch(tokens, cfg.data.global_batch, mcfg.seq_len, step, dp_rank, dp, cfg.job.seed)
        losses = []
        for m in range(layout["accum"]):
            x, y = x_all[m * micro:(m + 1) * micro].to(device), y_all[m * micro:(m + 1) * micro].to(device)
            losses.append(engine.loss(x, y, last_micro=m == layout["accum"] - 1).detach())
            if cfg.fault.kind == "nan" and rank == cfg.fault.rank and step >= cfg.fault.step:
                losses[-1] = losses[-1] * float("inf")
        inject_fault(cfg, rank, step)
        norm = engine.step()
        compute_s = time.perf_counter() - t0
        loss = torch.stack(losses).mean().reshape(1).to(device)
        t_sync = time.perf_counter()
        dist.all_reduce(loss)                           # also where every rank waits for the slowest one
        sync_s = time.perf_counter() - t_sync
        step_s = time.perf_counter() - t0
        loss = float(loss.item()) / world
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
        if cfg.checkpoint.interval and (step + 1) % cfg.checkpoint.interval == 0:
            engine.save(ckpt, step + 1)
            if rank == 0:                               # what a resumed run continues: losses and alerts so far
                (out / "progress.json").write_text(json.dumps(record))
                _keep_newest(ckpt, cfg.checkpoint.keep)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
    writer.close()
    if bar is not None:
        bar.close()
    if rank == 0:
        record.update(config=cfg.to_dict(), world_size=world, layout=layout, restarts=_restart_count(),
                      final_params=_params_digest(engine))
        (out / "result.json").write_text(json.dumps(record, indent=1))
    else:
        _params_digest(engine)                          # a collective under FSDP2: every rank takes part
    return record


def _keep_newest(folder: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (rank 0, after the save's closing barrier)."""
    import shutil

    done = sorted(p for p in folder.glob("step_*") if p.is_dir())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _previous_record(out: Path) -> dict:
    """The record of the run that wrote the checkpoint we resume from (its losses, alerts, restarts)."""
    path = out / "progress.json"
    if path.exists():
        return json.loads(path.read_text())
    return {"losses": {}, "alerts": [], "resumed_from": []}


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
    from course_lib.train_config import load_config, validate_world

    cfg = load_config(config, overrides)
    layout = validate_world(cfg, nprocs)
    if cfg.parallelism.engine == "deepspeed":
        deepspeed_settings(cfg, layout)
    if cfg.fault.kind and cfg.fault.rank >= nprocs:
        from course_lib.config import ConfigError
        raise ConfigError(f"{cfg.source}: fault.rank: {cfg.fault.rank} but the run has {nprocs} ranks")
    return cfg, layout


def launch(config: str | Path, nprocs: int, overrides: dict | None = None, *, max_restarts: int = 0,
           timeout_s: float = 600.0, stream: bool = True, on_poll=None):
    """Validate, then run ``python -m course_lib.train --config CONFIG`` under torchrun on ``nprocs`` ranks (from a
    notebook or a test). Returns (`launch.RunResult`, the record rank 0 wrote). ``on_poll`` as in
    `launch.run_script` (lesson 09 follows the metrics file with it)."""
    from course_lib import launch as launcher

    cfg, _ = check(config, nprocs, overrides)
    args = ["--config", str(config)] + [f"--set={k}={json.dumps(v)}" for k, v in (overrides or {}).items()]
    result = launcher.run_script(Path(__file__), nprocs, args, timeout_s=timeout_s, stream=stream,
                                 max_restarts=max_restarts, on_poll=on_poll)
    return result, json.loads((cfg.out_dir / "result.json").read_text())


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
    parser = argparse.ArgumentParser(prog="python -m course_lib.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a TOML run config, e.g. configs/tiny_ddp.toml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a field (value in JSON: 40, 1e-3, true, \"ddp\")")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    parser.add_argument("--nprocs", type=int, default=None, help="with --check: the number of ranks")
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


if __name__ == "__main__":
    sys.exit(main())
