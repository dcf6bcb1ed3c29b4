"""The config of a training run, read from TOML in torchtitan's manner (lesson 09).

    cfg = load_config("configs/tiny_ddp.toml", overrides={"schedule.steps": 40})
    cfg.parallelism.engine, cfg.schedule.warmup_steps, cfg.checkpoint.interval

One section per concern, each a frozen dataclass that validates its fields; `validate_world` checks what needs the
world size (dp x tp x pp = ranks, the batch divisible into micro-batches). Every error is a `ConfigError` naming the
file, the field as ``section.key`` and the fix, raised before any process starts (`course_lib.training.command.launch`
and ``python -m course_lib.training --config X --check`` both validate first).

Sections and what they hold (defaults in the dataclasses below):

- ``[job]``: name, seed, out_dir (default ``runs/train/<name>``).
- ``[model]``: family ('course-gpt' or 'hf-gpt2': transformers' GPT2LMHeadModel built from the same shape), preset
  (`course_lib.config.PRESETS`, CPU-sized ones), optional shape overrides, dropout, activation_checkpointing;
  vocab_multiple (0: off; 128 pads the vocabulary to a multiple of 128, lesson 12: the course's GPT keeps its weights
  and gets zero rows; transformers' model is built at the padded shape, so all its weights differ from the unpadded
  model's of the same seed), compile (``torch.compile`` of the model's loss; engines 'ddp'
  and 'fsdp2'). Both off by default: they change the numbers.
- ``[data]``: source ('corpus': bytes of the offline text corpus, 'random'), global_batch, micro_batch (per rank),
  pad_fraction (up to this fraction of each sequence is padding: variable-length sequences), loss ('global_tokens':
  the summed loss over the global number of valid tokens, torchtitan's PR 2206; 'micro_batch_mean': each
  micro-batch's mean averaged, what weighs tokens unequally once sequences are padded).
- ``[optimizer]``: name ('adamw', 'sgd'), lr (the peak), betas, eps, weight_decay; implementation ('default': torch's
  choice, 'for-loop', 'foreach', 'fused': `parallel.fast_step.OPTIMIZER_IMPLS`, the same update in fewer kernels).
- ``[schedule]``: name ('warmup_cosine', 'warmup_constant', 'constant'), warmup_steps, steps (total), min_lr.
- ``[parallelism]``: engine ('ddp', 'fsdp2', 'deepspeed'), dp (-1: what is left), tp, pp.
- ``[precision]``: dtype ('float32', or 'bfloat16': the forward and the loss under bf16 autocast; engines 'ddp' and
  'fsdp2', DeepSpeed takes its own ``bf16`` section); weights ('float32', or 'bfloat16': bf16 parameters in the
  forward and backward with fp32 master weights and optimizer state, FSDP2's ``MixedPrecisionPolicy(param_dtype=
  bfloat16, reduce_dtype=float32)``, whose sharded fp32 parameters are the masters; engine 'fsdp2' only).
- ``[clipping]``: max_norm (global gradient norm; 0 turns clipping off).
- ``[checkpoint]``: interval (steps; 0: never), folder, async_save, keep.
- ``[logging]``: interval, tensorboard, alerts; alert_seconds_per_step (0: the rules' durations run on the wall
  clock; N: on a clock that advances N seconds per step, so that "for 10 minutes" means 600 / N steps whatever the
  machine's speed), alert_thresholds (per rule name, e.g. ``{throughput_low = 1.0}``).
- ``[fault]``: an injected fault for the lesson and the tests (kind, rank, step, seconds, factor), first attempt
  only: 'spike' poisons the global batch at data position ``step`` (its targets scrambled on every rank), 'lr_jump'
  multiplies the learning rate of the update of step ``step`` by ``factor`` (first pass only), 'hang' stops rank
  ``rank`` at step ``step`` without dying.
- ``[spikes]``: loss-spike detection and PaLM's recovery (`course_lib.training.spikes`): detect, window, warmup, z (the
  z-score detector on the loss and the gradient norm); rewind (go back to the newest checkpoint at least
  ``min_steps_back`` steps before the spike, skip the batches read since it and ``skip_batches`` more), lr_factor
  (the learning rate after each rewind is multiplied by it), max_rewinds.
- ``[watchdog]``: timeout_s (0: off; a rank without progress for this long is named and stopped, and with
  ``--max-restarts`` the job resumes from its checkpoint: `course_lib.training.watchdog`), poll_s, step_seconds (the longest
  a healthy step takes on this machine, a checkpoint save included, measured: a timeout shorter is refused).
- ``[deepspeed]``: config (a JSON file, relative to the TOML) or an inline ``[deepspeed.inline]`` table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from course_lib.config import ConfigError, ModelConfig, get_preset

if sys.version_info >= (3, 11):
    import tomllib
else:                                                  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["ConfigError", "RunConfig", "load_config", "parse_config", "validate_world", "FAULT_KINDS"]

FAULT_KINDS = ("sigkill", "exit", "exception", "segfault", "nan", "slow", "hang", "spike", "lr_jump")
LOSS_MODES = ("global_tokens", "micro_batch_mean")


def _check(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {message}")


def _int(where: str, value: Any, low: int = 0) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= low, where,
           f"{value!r} must be an int >= {low}")


def _number(where: str, value: Any, low: float = 0.0) -> None:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
           and value >= low, where, f"{value!r} must be a number >= {low}")


def _choice(where: str, value: Any, choices: tuple) -> None:
    _check(value in choices, where, f"{value!r} is unknown: pick one of {', '.join(map(repr, choices))}")


@dataclass(frozen=True)
class Job:
    name: str = "train"
    seed: int = 0
    out_dir: str = ""

    def validate(self) -> None:
        _check(isinstance(self.name, str) and self.name.replace("-", "").replace("_", "").isalnum(), "job.name",
               f"{self.name!r} must be letters, digits, '-' or '_' (it names the run's folder)")
        _int("job.seed", self.seed)


@dataclass(frozen=True)
class Model:
    family: str = "course-gpt"
    preset: str = "tiny"
    n_layer: int | None = None
    n_head: int | None = None
    d_model: int | None = None
    seq_len: int | None = None
    dropout: float = 0.0
    activation_checkpointing: bool = False
    vocab_multiple: int = 0
    compile: bool = False

    def validate(self) -> None:
        _choice("model.family", self.family, ("course-gpt", "hf-gpt2"))
        _int("model.vocab_multiple", self.vocab_multiple)
        for name in ("activation_checkpointing", "compile"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"model.{name}", f"{value!r} must be true/false")
        try:
            self.config()
        except ConfigError as exc:
            raise ConfigError(f"model: {exc}") from None
        _check(0.0 <= self.dropout < 1.0, "model.dropout", f"{self.dropout!r} must be in [0, 1)")

    def config(self) -> ModelConfig:
        """The `ModelConfig`: the preset with the overrides given here."""
        changes = {k: getattr(self, k) for k in ("n_layer", "n_head", "d_model", "seq_len") if getattr(self, k)}
        return get_preset(self.preset).replace(dropout=self.dropout, **changes)


@dataclass(frozen=True)
class Data:
    source: str = "corpus"
    global_batch: int = 8
    micro_batch: int = 2
    pad_fraction: float = 0.0
    loss: str = "global_tokens"

    def validate(self) -> None:
        _choice("data.source", self.source, ("corpus", "random"))
        _int("data.global_batch", self.global_batch, 1)
        _int("data.micro_batch", self.micro_batch, 1)
        _number("data.pad_fraction", self.pad_fraction)
        _check(self.pad_fraction < 1.0, "data.pad_fraction",
               f"{self.pad_fraction!r} must be below 1 (0.5: sequences keep at least half their tokens)")
        _choice("data.loss", self.loss, LOSS_MODES)


@dataclass(frozen=True)
class Optimizer:
    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    implementation: str = "default"

    def validate(self) -> None:
        from course_lib.parallel.fast_step import OPTIMIZER_IMPLS

        _choice("optimizer.name", self.name, ("adamw", "sgd"))
        _choice("optimizer.implementation", self.implementation, tuple(OPTIMIZER_IMPLS))
        _check(isinstance(self.lr, (int, float)) and self.lr > 0, "optimizer.lr", f"{self.lr!r} must be > 0")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optimizer.betas",
               f"{list(self.betas)!r} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
        _number("optimizer.eps", self.eps)
        _number("optimizer.weight_decay", self.weight_decay)


@dataclass(frozen=True)
class Schedule:
    name: str = "warmup_cosine"
    warmup_steps: int = 0
    steps: int = 20
    min_lr: float = 0.0

    def validate(self) -> None:
        _choice("schedule.name", self.name, ("warmup_cosine", "warmup_constant", "constant"))
        _int("schedule.steps", self.steps, 1)
        _int("schedule.warmup_steps", self.warmup_steps)
        _check(self.warmup_steps <= self.steps, "schedule.warmup_steps",
               f"{self.warmup_steps} exceeds schedule.steps={self.steps}: use at most {self.steps}")
        _number("schedule.min_lr", self.min_lr)


@dataclass(frozen=True)
class Parallelism:
    engine: str = "ddp"
    dp: int = -1
    tp: int = 1
    pp: int = 1

    def validate(self) -> None:
        _choice("parallelism.engine", self.engine, ("ddp", "fsdp2", "deepspeed"))
        _check(self.dp == -1 or (isinstance(self.dp, int) and self.dp >= 1), "parallelism.dp",
               f"{self.dp!r} must be a positive int, or -1 for the ranks that tp x pp leaves")
        _int("parallelism.tp", self.tp, 1)
        _int("parallelism.pp", self.pp, 1)
        _check(self.pp == 1, "parallelism.pp",
               f"{self.pp}: the training script runs no pipeline yet (lessons 03 and 08 do); use pp = 1")
        _check(self.tp == 1, "parallelism.tp",
               f"{self.tp}: the training script runs data parallel (DDP, FSDP2, DeepSpeed ZeRO) only so far; tensor "
               f"parallelism is lessons 04 and 08's: use tp = 1")


@dataclass(frozen=True)
class Precision:
    dtype: str = "float32"
    weights: str = "float32"

    def validate(self) -> None:
        _choice("precision.dtype", self.dtype, ("float32", "bfloat16"))
        _choice("precision.weights", self.weights, ("float32", "bfloat16"))


@dataclass(frozen=True)
class Clipping:
    max_norm: float = 1.0

    def validate(self) -> None:
        _number("clipping.max_norm", self.max_norm)


@dataclass(frozen=True)
class Checkpoint:
    interval: int = 0
    folder: str = "checkpoints"
    async_save: bool = False
    keep: int = 2

    def validate(self) -> None:
        _int("checkpoint.interval", self.interval)
        _int("checkpoint.keep", self.keep, 1)
        _check(isinstance(self.async_save, bool), "checkpoint.async_save", f"{self.async_save!r} must be true/false")


@dataclass(frozen=True)
class Logging:
    interval: int = 1
    tensorboard: bool = True
    alerts: bool = True
    alert_seconds_per_step: float = 0.0
    alert_thresholds: dict = field(default_factory=dict)

    def validate(self) -> None:
        _int("logging.interval", self.interval, 1)
        _number("logging.alert_seconds_per_step", self.alert_seconds_per_step)
        from course_lib.training.alerts import SEED_RULES

        names = {r.name for r in SEED_RULES}
        for name, value in self.alert_thresholds.items():
            _check(name in names, f"logging.alert_thresholds.{name}", f"no such rule: the rules are {sorted(names)}")
            _number(f"logging.alert_thresholds.{name}", value)

    def rules(self) -> tuple:
        """The seed's alert rules with this run's thresholds (a tiny model on a CPU is not a GPU cluster)."""
        from course_lib.training.alerts import SEED_RULES

        return tuple(dataclasses.replace(r, threshold=self.alert_thresholds.get(r.name, r.threshold))
                     for r in SEED_RULES)


@dataclass(frozen=True)
class Fault:
    kind: str = ""
    rank: int = 0
    step: int = 0
    seconds: float = 0.0
    factor: float = 30.0

    def validate(self) -> None:
        if self.kind:
            _choice("fault.kind", self.kind, FAULT_KINDS)
            _int("fault.rank", self.rank)
            _int("fault.step", self.step)
            _number("fault.seconds", self.seconds)
            _number("fault.factor", self.factor)
            _check(self.kind != "lr_jump" or self.factor > 1, "fault.factor",
                   f"{self.factor!r}: an lr_jump multiplies the learning rate by factor > 1, e.g. 30")

    def spike_step(self) -> int | None:
        """The step whose loss the injected fault makes spike (None: no such fault): the poisoned batch's own step
        ('spike', while no batch was skipped), or the step after the jumped update ('lr_jump')."""
        return {"spike": self.step, "lr_jump": self.step + 1}.get(self.kind)


@dataclass(frozen=True)
class Spikes:
    detect: bool = False
    window: int = 20
    warmup: int = 10
    z: float = 6.0
    rewind: bool = True
    min_steps_back: int = 1
    skip_batches: int = 0
    lr_factor: float = 1.0
    max_rewinds: int = 3

    def validate(self) -> None:
        for name in ("detect", "rewind"):
            _check(isinstance(getattr(self, name), bool), f"spikes.{name}", f"{getattr(self, name)!r} must be "
                   f"true/false")
        _int("spikes.window", self.window, 2)
        _int("spikes.warmup", self.warmup, 2)
        _check(self.warmup <= self.window, "spikes.warmup",
               f"{self.warmup} exceeds spikes.window = {self.window}: use warmup <= window")
        _check(isinstance(self.z, (int, float)) and not isinstance(self.z, bool) and self.z > 0, "spikes.z",
               f"{self.z!r} must be a positive number of standard deviations, e.g. 6")
        _int("spikes.min_steps_back", self.min_steps_back, 1)
        _int("spikes.skip_batches", self.skip_batches)
        _check(isinstance(self.lr_factor, (int, float)) and 0 < self.lr_factor <= 1, "spikes.lr_factor",
               f"{self.lr_factor!r} must be in (0, 1]: 1 keeps the learning rate, 0.5 halves it after each rewind")
        _int("spikes.max_rewinds", self.max_rewinds)


@dataclass(frozen=True)
class Watchdog:
    timeout_s: float = 0.0
    poll_s: float = 0.5
    step_seconds: float = 0.0

    def validate(self) -> None:
        _number("watchdog.timeout_s", self.timeout_s)
        _number("watchdog.poll_s", self.poll_s)
        _check(self.poll_s > 0, "watchdog.poll_s", f"{self.poll_s!r} must be > 0 seconds, e.g. 0.5")
        _number("watchdog.step_seconds", self.step_seconds)


@dataclass(frozen=True)
class RunConfig:
    """A whole training run; `load_config` builds it from TOML."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    optimizer: Optimizer = field(default_factory=Optimizer)
    schedule: Schedule = field(default_factory=Schedule)
    parallelism: Parallelism = field(default_factory=Parallelism)
    precision: Precision = field(default_factory=Precision)
    clipping: Clipping = field(default_factory=Clipping)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    logging: Logging = field(default_factory=Logging)
    fault: Fault = field(default_factory=Fault)
    spikes: Spikes = field(default_factory=Spikes)
    watchdog: Watchdog = field(default_factory=Watchdog)
    deepspeed: dict = field(default_factory=dict)      # the DeepSpeed JSON config, as DeepSpeed reads it
    source: str = ""                                   # the TOML file it came from

    @property
    def out_dir(self) -> Path:
        return Path(self.job.out_dir or f"runs/train/{self.job.name}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTIONS = {"job": Job, "model": Model, "data": Data, "optimizer": Optimizer, "schedule": Schedule,
             "parallelism": Parallelism, "precision": Precision, "clipping": Clipping, "checkpoint": Checkpoint,
             "logging": Logging, "fault": Fault, "spikes": Spikes, "watchdog": Watchdog, "deepspeed": dict}


def parse_config(raw: dict, source: str = "<dict>", base: Path | None = None) -> RunConfig:
    """A validated `RunConfig` from a TOML-shaped dict; ``base`` is the folder that relative paths start from."""
    sections = {}
    for name, value in raw.items():
        _check(name in _SECTIONS, source, f"unknown section [{name}]: the sections are {', '.join(_SECTIONS)}")
        _check(isinstance(value, dict), f"{source}: [{name}]", "must be a table")
        if name == "deepspeed":
            sections[name] = _deepspeed_json(value, source, base or Path("."))
            continue
        cls = _SECTIONS[name]
        known = {f.name for f in dataclasses.fields(cls)}
        for key in value:
            _check(key in known, f"{source}: {name}.{key}", f"unknown field: [{name}] has {', '.join(sorted(known))}")
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
        sections[name] = cls(**fields)
    cfg = RunConfig(**sections, source=source)
    for name in _SECTIONS:
        section = getattr(cfg, name)
        if hasattr(section, "validate"):
            try:
                section.validate()
            except ConfigError as exc:
                raise ConfigError(f"{source}: {exc}") from None
    _check(cfg.parallelism.engine != "deepspeed" or bool(cfg.deepspeed), f"{source}: [deepspeed]",
           "engine = 'deepspeed' needs a [deepspeed] section: config = 'FILE.json' or an [deepspeed.inline] table")
    _check_run(cfg)
    return cfg


def _check_run(cfg: RunConfig) -> None:
    """What no single section can see: a fault the run never reaches, a spike with no checkpoint to go back to, a
    watchdog that would call a healthy step a hang."""
    where, f, s, c, steps = cfg.source, cfg.fault, cfg.spikes, cfg.checkpoint, cfg.schedule.steps
    if f.kind:
        last = steps - 2 if f.kind == "lr_jump" else steps - 1       # an lr_jump shows in the step after it
        _check(f.step <= last, f"{where}: fault.step",
               f"{f.step} is past the run's end (schedule.steps = {steps}{', and an lr_jump shows one step later' if f.kind == 'lr_jump' else ''}): "
               f"use a step <= {last} or more steps")
    rewinds = s.detect and s.rewind
    if rewinds:
        _check(cfg.parallelism.engine != "deepspeed", f"{where}: spikes.rewind",
               "the script rewinds DDP and FSDP2 runs; under engine 'deepspeed' set spikes.rewind = false (detect only)")
        _check(c.interval > 0, f"{where}: spikes.rewind",
               "a rewind goes back to a checkpoint and checkpoint.interval = 0 takes none: set checkpoint.interval "
               "(e.g. 10) or spikes.rewind = false")
        _check((c.keep - 1) * c.interval >= s.min_steps_back, f"{where}: checkpoint.keep",
               f"{c.keep} checkpoints every {c.interval} steps may not hold one spikes.min_steps_back = "
               f"{s.min_steps_back} steps before a spike: keep at least {1 + -(-s.min_steps_back // c.interval)}")
    spike = f.spike_step()
    if spike is not None and s.detect:
        _check(spike >= s.warmup, f"{where}: fault.step",
               f"the injected {f.kind} shows at step {spike}, before the detector's warm-up of spikes.warmup = "
               f"{s.warmup} steps: it would not be judged; inject at step >= {s.warmup - (f.kind == 'lr_jump')} "
               f"or lower spikes.warmup")
        if rewinds:
            _check(c.interval <= spike - s.min_steps_back, f"{where}: checkpoint.interval",
                   f"the first checkpoint (step {c.interval}) comes after step {spike} - spikes.min_steps_back = "
                   f"{spike - s.min_steps_back}: there is no checkpoint to rewind to before the spike; use "
                   f"checkpoint.interval <= {max(spike - s.min_steps_back, 0)} or inject later")
    engine = cfg.parallelism.engine
    _check(cfg.precision.weights == "float32" or engine == "fsdp2", f"{where}: precision.weights",
           f"bf16 weights with fp32 masters run under engine 'fsdp2' (MixedPrecisionPolicy), not {engine!r}: set "
           f"parallelism.engine = 'fsdp2'" + (", or enable bf16 in the [deepspeed] JSON" if engine == "deepspeed"
                                               else ", or keep weights = 'float32' and use dtype = 'bfloat16'"))
    if engine == "deepspeed":
        _check(cfg.precision.dtype == "float32", f"{where}: precision.dtype",
               "DeepSpeed takes its precision from its own config: set bf16.enabled in the [deepspeed] JSON and "
               "leave precision.dtype = 'float32'")
        _check(not cfg.model.compile, f"{where}: model.compile",
               "the script compiles under engines 'ddp' and 'fsdp2' only: set model.compile = false")
    w = cfg.watchdog
    if w.timeout_s:
        _check(w.step_seconds > 0, f"{where}: watchdog.step_seconds",
               "declare how long a healthy step takes here (result.json's step_s, plus a checkpoint save), so that a "
               "timeout shorter than a step is refused: e.g. step_seconds = 0.5")
        _check(w.timeout_s > w.step_seconds, f"{where}: watchdog.timeout_s",
               f"{w.timeout_s} s is not longer than a step (watchdog.step_seconds = {w.step_seconds} s): every "
               f"healthy rank would be called hung; use a timeout of several steps, e.g. {4 * w.step_seconds:g}")


def _deepspeed_json(section: dict, source: str, base: Path) -> dict:
    unknown = set(section) - {"config", "inline"}
    _check(not unknown, f"{source}: deepspeed.{next(iter(unknown), '')}", "unknown field: use config or inline")
    if "inline" in section:
        return dict(section["inline"])
    path = base / str(section.get("config", ""))
    _check(path.is_file(), f"{source}: deepspeed.config", f"{str(path)!r} is not a file: give a DeepSpeed JSON config")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{source}: deepspeed.config: {path} is not valid JSON ({exc})") from None


def _set(raw: dict, dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    _check(bool(key), dotted, "an override is 'section.key', e.g. 'schedule.steps'")
    raw.setdefault(section, {})[key] = value


def load_config(path: str | Path, overrides: dict | None = None) -> RunConfig:
    """Read, override (``{"schedule.steps": 40}``) and validate a TOML run config."""
    path = Path(path)
    _check(path.is_file(), str(path), "no such config file: give the path of a .toml file, e.g. configs/tiny_ddp.toml")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    for dotted, value in (overrides or {}).items():
        _set(raw, dotted, value)
    return parse_config(raw, str(path), path.parent)


def validate_world(cfg: RunConfig, world_size: int) -> dict:
    """The run's layout for ``world_size`` ranks: {'dp', 'tp', 'pp', 'accum'} (micro-batches per rank per step).
    Raises `ConfigError` naming the field when the ranks or the batch do not divide."""
    p, where = cfg.parallelism, cfg.source
    dp = p.dp if p.dp != -1 else world_size // (p.tp * p.pp)
    _check(dp * p.tp * p.pp == world_size, f"{where}: parallelism",
           f"dp x tp x pp = {dp} x {p.tp} x {p.pp} = {dp * p.tp * p.pp} but the run has {world_size} ranks: "
           f"set dp = -1 or make the product equal the number of ranks")
    d = cfg.data
    _check(d.global_batch % (d.micro_batch * dp) == 0, f"{where}: data.global_batch",
           f"{d.global_batch} is not a multiple of data.micro_batch x dp = {d.micro_batch} x {dp}: "
           f"use a multiple of {d.micro_batch * dp}")
    n_head = cfg.model.config().n_head
    _check(n_head % p.tp == 0, f"{where}: parallelism.tp", f"tp={p.tp} does not divide n_head={n_head}")
    return {"dp": dp, "tp": p.tp, "pp": p.pp, "accum": d.global_batch // (d.micro_batch * dp)}
