"""The model, optimizer and schedule behind one step of the training script (lesson 09), whatever the engine.

    engine = Engine(cfg, layout, device)            # PyTorch DDP, FSDP2 or DeepSpeed ZeRO, as [parallelism] says
    loss = engine.loss(x, y, last_micro=True)       # forward and backward of one micro-batch
    norm = engine.step()                            # clip the global gradient norm, step the optimizer and schedule
    engine.save(folder, step, position, extra); state = engine.resume(folder)

The model is plain (`course_lib.model.build_model`, or transformers' GPT2LMHeadModel of the same shape, built from
the job's seed) and the engine applies the technique to it: DDP wraps `LossOf(model)` and all-reduces the gradients
after the last micro-batch only; FSDP2 shards every block, then the model (``fully_shard``); DeepSpeed ZeRO takes the
``[deepspeed]`` JSON that `deepspeed_settings` checks against ``[data]`` and steps inside its own engine. The
optimizer (SGD or AdamW) and the learning-rate schedule (`parallel.schedules`) come from the TOML config
(`course_lib.training.config`); the global gradient norm is clipped across shards (`parallel.clipping`); checkpoints
are `parallel.dist_checkpoint`'s (DeepSpeed's own with engine 'deepspeed').

Lesson 12's switches, all off by default: ``[model] vocab_multiple`` (`model.pad_vocab`), ``[model] compile``
(``torch.compile`` of the wrapped loss: DDP's or FSDP2's), ``[optimizer] implementation`` (for-loop / foreach /
fused, `parallel.fast_step`), ``[precision] dtype = 'bfloat16'`` (the forward under bf16 autocast) and ``[precision]
weights = 'bfloat16'`` (FSDP2's MixedPrecisionPolicy: bf16 parameters in compute, fp32 shards as master weights,
gradients reduced in fp32).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

__all__ = ["Engine", "LossOf", "deepspeed_settings"]


def _build_model(cfg, device):
    """The plain model (same weights on every rank: built from the job's seed) and its loss(x, y)."""
    from course_lib.model import build_model, hf_gpt2_config, lm_loss, pad_vocab

    mcfg, multiple = cfg.model.config(), cfg.model.vocab_multiple
    if cfg.model.family == "course-gpt":
        model = build_model(mcfg, cfg.job.seed)
        if multiple:                                     # the same weights, extra rows zero (lesson 12)
            model = pad_vocab(model, multiple)
        if cfg.model.activation_checkpointing:
            from course_lib.parallel.checkpointing import apply_activation_checkpointing
            apply_activation_checkpointing(model)
        blocks = list(model.blocks)
    else:
        from transformers import GPT2LMHeadModel

        torch.manual_seed(cfg.job.seed)
        model = GPT2LMHeadModel(hf_gpt2_config(mcfg.padded_vocab(multiple) if multiple else mcfg))
        if cfg.model.activation_checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model.loss = lambda x, y: lm_loss(model(x).logits, y)
        blocks = list(model.transformer.h)
    return model.to(device), blocks


def _optimizer(cfg, params):
    from course_lib.parallel.fast_step import optimizer_impl

    o = cfg.optimizer
    impl = optimizer_impl(o.implementation)              # {} (torch's choice), foreach= or fused=
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay, **impl)
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **impl)


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
        self.autocast = cfg.precision.dtype == "bfloat16"
        if self.kind == "deepspeed":
            self._init_deepspeed(model, layout)
            return
        if self.kind == "ddp":
            self.net = nn.parallel.DistributedDataParallel(LossOf(model, self.summed)) \
                if dist.get_world_size() > 1 else LossOf(model, self.summed)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(device.type, (layout["dp"],))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if cfg.precision.weights == "bfloat16" else MixedPrecisionPolicy()    # fp32 shards = the masters
            for block in blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            self.net = LossOf(model, self.summed)
        self.optimizer = _optimizer(cfg, model.parameters())
        self.scheduler = _scheduler(cfg, self.optimizer)
        self._no_sync = getattr(self.net, "no_sync", None)
        if cfg.model.compile:                           # DDP's buckets split the graph (torch's DDPOptimizer)
            self.net = torch.compile(self.net, dynamic=False)

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
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss = self.net(x, y)                    # the loss itself in fp32 (autocast's cross_entropy rule)
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

    def describe(self, x) -> dict:
        """What this engine built, read from the objects, not from the config (result.json's ``built``): the
        vocabulary rows of the input embedding (padding pads the LM head alike), the optimizer's implementation
        flags, whether the step is compiled, autocast, and the dtype of the first matmul's weight during a forward
        of ``x`` (FSDP2's param_dtype, else the stored dtype). The forward is collective under FSDP2: every rank
        calls this."""
        if self.ds_engine is not None:
            return {"engine": "deepspeed"}
        seen = []
        first = next(m for m in self.model.modules() if type(m).__name__ in ("Linear", "Conv1D"))
        hook = first.register_forward_pre_hook(lambda mod, args: seen.append(str(mod.weight.dtype)))
        try:
            with torch.no_grad():
                self.model(x)
        finally:
            hook.remove()
        from course_lib.parallel.fast_step import implementation_of

        return {"vocab_rows": int(self.model.get_input_embeddings().weight.shape[0])
                if hasattr(self.model, "get_input_embeddings") else int(self.model.tok_emb.weight.shape[0]),
                "optimizer": implementation_of(self.optimizer),
                "compiled": hasattr(self.net, "_orig_mod"),                      # torch.compile's OptimizedModule
                "autocast": self.autocast, "forward_weight_dtype": seen[0].replace("torch.", "")}

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

