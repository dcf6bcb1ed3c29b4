"""What lesson 09 runs: the learning-rate schedules side by side, a too-high learning rate with and without warm-up,
global gradient-norm clipping on DP x TP ranks, the training script watched live, and a rank killed for good.

    curves = lr_curves(peak_lr=3e-3, warmup_steps=10, total_steps=60, min_lr=3e-4)   # ours, torch, DeepSpeed
    runs = warmup_runs(get_preset("tiny"), peak_lr=0.2, warmup_steps=15, steps=30)    # one process
    out = run(rank_clip_dp_tp, 4, args=(cfg, x, y, 0.05)).returns                    # DP 2 x TP 2
    result, record, records = watch_training("configs/tiny_ddp.toml", 2, overrides)  # live plot + progress bar

Section 7 (when a large run goes wrong): the script's loss spike, rewound and skipped (`passes`, `spike_rows`),
and a loss that counts tokens right on DP 2 x accumulation 2 against one process (`token_loss_runs`); the rest of
that section's experiments are in `large_runs` (instability, async saves, resharding).

The training script itself is `course_lib.training` (its command line `command`, its loop `train`, its step
`engine`); its pieces are `parallel.schedules`, `parallel.clipping`, `parallel.dist_checkpoint`,
`course_lib.training.monitor`, `course_lib.training.alerts`, `course_lib.training.spikes`,
`course_lib.training.watchdog` and `course_lib.training.token_loss`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.config import ModelConfig
from course_lib.data import get_batch, shard_batch, text_corpus
from course_lib.runtime.launch import run
from course_lib.lessons.errors import relative_error
from course_lib.model import build_model
from course_lib.parallel import schedules
from course_lib.parallel.deepspeed_config import import_deepspeed

CONFIGS = Path(__file__).resolve().parents[3] / "configs"     # the repository's configs/, from any working folder
RUNS = Path(__file__).resolve().parents[3] / "runs" / "train"

__all__ = ["CONFIGS", "RUNS", "lr_curves", "warmup_runs", "one_process_clip", "dp_tp_gradients", "rank_clip_dp_tp",
           "watch_training",
           "step_times", "time_lost", "torchrun_failures", "rank_sigkill", "passes", "spike_rows", "trend_rows",
           "final_loss",
           "stack_dump", "loader_resume", "token_loss_runs"]


# ----------------------------------------------------------------------------- 1. schedules

def _rates(optimizer, scheduler, n: int, deepspeed: bool = False) -> list[float]:
    """The rate each of n optimizer updates uses. torch: read, step the optimizer, then the scheduler. DeepSpeed's
    schedulers start at iteration -1: step() first, then read (iteration s = update s)."""
    lrs = []
    for _ in range(n):
        if deepspeed:
            scheduler.step()
            lrs.append(scheduler.get_last_lr()[0])
        else:
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    return lrs


def lr_curves(peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
              deepspeed: bool = True) -> dict[str, list[float]]:
    """The rate of every update s = 0..total_steps-1, written five ways (lesson 09, section 1):

    'ours' (`schedules.warmup_cosine`, closed form), 'lambda' (its torch ``LambdaLR``), 'torch' (LinearLR +
    CosineAnnealingLR in SequentialLR, `schedules.torch_warmup_cosine`), and with ``deepspeed`` DeepSpeed's own
    scheduler objects: 'ds_cosine' (``WarmupCosineLR``) and 'ds_warmup' (``WarmupLR``, warm-up then constant) with
    the parameters `schedules.deepspeed_scheduler_config` chooses (``warmup_type='linear'``), and 'ds_cosine_log',
    the same ``WarmupCosineLR`` with DeepSpeed's default ``warmup_type='log'``; 'warmup_constant' is our twin of
    WarmupLR. DeepSpeed's rates are those of iteration s = 0, 1, ... (see `schedules`' docstring for what an engine
    uses at update s)."""
    kw = dict(peak_lr=peak_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    n = total_steps

    def opt(lr=peak_lr):
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)

    out = {"ours": [schedules.warmup_cosine(s, **kw) for s in range(n)],
           "warmup_constant": [schedules.warmup_constant(s, peak_lr, warmup_steps) for s in range(n)]}
    o = opt()
    out["lambda"] = _rates(o, schedules.warmup_cosine_scheduler(o, **kw), n)
    o = opt(1.0)                                  # torch_warmup_cosine sets the rate itself
    out["torch"] = _rates(o, schedules.torch_warmup_cosine(o, **kw), n)
    if deepspeed:
        import_deepspeed()
        from deepspeed.runtime import lr_schedules
        from deepspeed.utils import logger

        level = logger.level
        logger.setLevel("ERROR")            # its warning when a scheduler is read before its first step()
        try:
            cos = schedules.deepspeed_scheduler_config("WarmupCosineLR", **kw)["params"]
            out["ds_cosine"] = _rates(None, lr_schedules.WarmupCosineLR(opt(), **cos), n, deepspeed=True)
            out["ds_cosine_log"] = _rates(None, lr_schedules.WarmupCosineLR(opt(), **{**cos, "warmup_type": "log"}),
                                          n, deepspeed=True)
            warm = schedules.deepspeed_scheduler_config("WarmupLR", peak_lr=peak_lr,
                                                        warmup_steps=warmup_steps)["params"]
            out["ds_warmup"] = _rates(None, lr_schedules.WarmupLR(opt(), **warm), n, deepspeed=True)
        finally:
            logger.setLevel(level)
    return out


# ----------------------------------------------------------------------------- 1.2 warm-up or not

def warmup_runs(cfg: ModelConfig, peak_lr: float, warmup_steps: int, steps: int, batch: int = 16,
                seed: int = 0, warmups: tuple[int, ...] | None = None) -> dict[int, dict]:
    """Train the course's GPT in this process with AdamW at ``peak_lr`` and a warm-up + cosine schedule (to
    peak_lr / 10), once per warm-up length in ``warmups`` (default: none, and ``warmup_steps``); the same model,
    data (bytes of the offline corpus, `data.get_batch` as the training script draws them) and seed each time.
    No clipping: the schedule alone decides. Returns {warm-up steps: {'losses', 'grad_norms', 'lrs', 'seconds'}}."""
    tokens = text_corpus(2_000_000).long() % cfg.vocab_size
    out = {}
    for warm in warmups if warmups is not None else (0, warmup_steps):
        t0 = time.perf_counter()
        model = build_model(cfg, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
        sched = schedules.warmup_cosine_scheduler(opt, peak_lr=peak_lr, warmup_steps=warm, total_steps=steps,
                                                  min_lr=peak_lr / 10)
        rec = {"losses": [], "grad_norms": [], "lrs": []}
        for step in range(steps):
            x, y = get_batch(tokens, batch, cfg.seq_len, step, seed=seed)      # (B, T) each
            rec["lrs"].append(opt.param_groups[0]["lr"])
            loss = model.loss(x, y)
            loss.backward()
            rec["grad_norms"].append(torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None]).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            rec["losses"].append(loss.item())
        rec["seconds"] = time.perf_counter() - t0
        out[warm] = rec
    return out


# ----------------------------------------------------------------------------- 2. clipping across shards

def one_process_clip(cfg: ModelConfig, x: torch.Tensor, y: torch.Tensor, max_norm: float) -> dict:
    """The reference: one process on the global batch, ``torch.nn.utils.clip_grad_norm_``. Returns {'norm' (before
    clipping), 'clipped' {name: gradient after clipping}}."""
    model = build_model(cfg, seed=0)
    model.loss(x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    return {"norm": norm, "clipped": {k: p.grad.clone() for k, p in model.named_parameters()}}


def dp_tp_gradients(cfg: ModelConfig, x: torch.Tensor, y: torch.Tensor):
    """On 4 ranks as DP 2 x TP 2: the course's tensor-parallel GPT (lesson 04) on this rank's rows of the global
    batch, backward, gradients averaged over dp (lesson 02). Returns (model, grid, `clipping.tensor_parallel_grad_parts`
    of the model: every gradient with the groups it is sharded over, None for a replicated one)."""
    from course_lib.dist import ProcessGrid
    from course_lib.parallel.clipping import tensor_parallel_grad_parts
    from course_lib.parallel.ddp import average_gradients
    from course_lib.parallel.tensor_model import apply_tensor_parallel

    grid = ProcessGrid(dp=2, tp=2)
    tp, dp, dev = grid.group("tp"), grid.group("dp"), cdist.device()
    model = apply_tensor_parallel(build_model(cfg, seed=0).to(dev), tp)
    xs, ys = (shard_batch(t, grid.coord("dp"), 2).to(dev) for t in (x, y))      # (B/2, T): this replica's rows
    model.loss(xs, ys).backward()
    average_gradients(model, group=dp)
    return model, grid, tensor_parallel_grad_parts(model, tp)


def rank_clip_dp_tp(cfg: ModelConfig, x: torch.Tensor, y: torch.Tensor, max_norm: float, clipped: dict) -> dict:
    """On 4 ranks as DP 2 x TP 2 (`dp_tp_gradients`): the global norm of the gradient parts (shards summed over tp,
    replicated parameters counted once) and three wrong ways: every part summed over tp (replicated LayerNorms and
    biases counted twice), every part also summed over dp (the two identical replicas added), only the rank's own
    parts. Clips with the right norm and compares the clipped gradients with ``clipped`` (one process's,
    `one_process_clip`)."""
    from course_lib.parallel.clipping import clip_grad_norm_, global_grad_norm
    from course_lib.parallel.tensor_model import shard_like

    model, grid, parts = dp_tp_gradients(cfg, x, y)
    tp, dp = grid.group("tp"), grid.group("dp")
    out = {"replicated": sum(spec is None for _, spec in parts), "sharded": sum(spec is not None for _, spec in parts),
           "every_tp_rank": global_grad_norm([(g, tp) for g, _ in parts]).item(),
           "summed_over_dp": global_grad_norm([(g, (s or ()) + (dp,)) for g, s in parts]).item(),
           "local_only": global_grad_norm([(g, None) for g, _ in parts]).item()}
    out["norm"] = clip_grad_norm_(parts, max_norm).item()
    mine = {k: p.grad.cpu() for k, p in model.named_parameters()}
    out["clip_err"] = relative_error(mine, shard_like(model, clipped, tp))
    out["coords"] = {d: grid.coord(d) for d in ("dp", "tp")}
    return out


# ----------------------------------------------------------------------------- 3. watching a run

def watch_training(config: str | Path, nprocs: int, overrides: dict, *, plot=None, max_restarts: int = 0,
                   poll_s: float = 0.25, timeout_s: float = 600.0):
    """Run the training script (`command.launch`) and, while it runs, follow rank 0's ``metrics.jsonl`` as it grows
    (every ``poll_s``, from the launcher's wait loop in this thread: Ctrl-C stops the run and its processes): each
    new record goes to ``plot`` (a `monitor.LivePlot`, redrawn in place) and advances a progress bar. The run's
    folder (``job.out_dir``) is emptied first: a run starts from step 0, not from the checkpoints of an earlier run
    of the same name. Returns (RunResult, the record rank 0 wrote, every metrics record read)."""
    import sys

    from tqdm import tqdm                        # text, not a widget: a notebook's widgets are for controls

    from course_lib.training import command, monitor

    cfg, _ = command.check(config, nprocs, overrides)
    if cfg.out_dir.exists():                          # a run of the same name before: its checkpoints would be resumed
        shutil.rmtree(cfg.out_dir)
    jsonl = cfg.out_dir / "tb" / monitor.JSONL_NAME
    records: list[dict] = []
    state = {"offset": 0, "next": 0.0}
    bar = tqdm(total=cfg.schedule.steps, desc=f"{cfg.job.name} ({nprocs} ranks)", unit="step", file=sys.stdout,
               ncols=100, mininterval=0.5)

    def follow(force: bool = False) -> None:
        if not force and time.perf_counter() < state["next"]:
            return
        state["next"] = time.perf_counter() + poll_s
        new, state["offset"] = monitor.follow(jsonl, state["offset"])
        if new:
            records.extend(new)
            if plot is not None:
                plot.update(new)
            bar.n = max(r["step"] for r in new) + 1
            bar.set_postfix(loss=f"{new[-1]['loss']:.3f}", lr=f"{new[-1]['lr']:.1e}")
            bar.refresh()

    try:
        result, record = command.launch(config, nprocs, overrides, max_restarts=max_restarts, stream=False,
                                        timeout_s=timeout_s, on_poll=follow)
        follow(force=True)                           # the last records, written just before the ranks ended
    finally:
        bar.close()
    return result, record, records


def step_times(records: list[dict]) -> dict[str, float]:
    """From a run's metrics records: the median step time (s) and the median time a checkpoint save added (the gap
    between two consecutive records beyond the later step's own time, at the steps that followed a save)."""
    import statistics

    steps = [r["step_s"] for r in records]
    gaps = [b["time"] - a["time"] - b["step_s"] for a, b in zip(records, records[1:]) if b["step"] == a["step"] + 1]
    big = [g for g in gaps if g > 3 * statistics.median(steps)]
    return {"step_s": statistics.median(steps), "save_s": statistics.median(big) if big else 0.0}


def time_lost(records: list[dict]) -> dict:
    """When a run was killed and resumed: the records of both attempts (the second writes again the steps from its
    checkpoint on). Returns {'last_before' (the last step the first attempt finished), 'resumed_at' (the first step
    the second attempt wrote), 'lost_s' (when the second attempt finished ``last_before`` minus when the first did:
    the time the failure cost), 'redone' (steps computed twice), 'redo_s' (their time in the second attempt),
    'restart_s' (the rest: detecting the death, starting processes, loading the checkpoint)}."""
    restart = next((i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"]), None)
    if restart is None:
        raise ValueError("the records show no restart: no step was written twice")
    first, second = records[:restart], records[restart:]
    last = first[-1]["step"]
    again = next(r for r in second if r["step"] == last)
    redone = [r for r in second if r["step"] <= last]
    redo_s = sum(r["step_s"] for r in redone)
    lost = again["time"] - first[-1]["time"]
    return {"last_before": last, "resumed_at": second[0]["step"], "lost_s": lost, "redone": len(redone),
            "redo_s": redo_s, "restart_s": lost - redo_s}


def torchrun_failures(run_dir: str | Path) -> list[str]:
    """What torchrun's elastic agent logged about each worker that failed (``failed (exitcode: -9) local_rank: 1``;
    a negative exit code is a signal, named here), from the launcher log of a run: under ``--max-restarts`` the
    run succeeds, and this log is where the death is written down."""
    text = (Path(run_dir) / "launcher.log").read_text(errors="replace")
    lines = []
    for m in re.finditer(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)", text):
        code = int(m.group(1))
        why = f" = {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else ""
        lines.append(f"torchrun: local_rank {m.group(2)} (pid {m.group(3)}) failed, exitcode {code}{why}")
    return lines


def rank_sigkill(victim: int) -> int:
    """Every rank joins one all-reduce; then rank ``victim`` is killed by SIGKILL (as the out-of-memory killer does)
    and the others wait for it in a second one. For the launcher's message (`launch.DistributedRunError`)."""
    t = torch.ones(1, device=cdist.device())
    dist.all_reduce(t)
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)                                   # the survivors fail here: their peer is gone
    return dist.get_rank()


# ----------------------------------------------------------------------------- 7. when a large run goes wrong

def passes(records: list[dict]) -> list[list[dict]]:
    """A run's metrics records cut where the step goes back (a rewind after a spike, a restart after a failure):
    each pass is a list of records with increasing steps, in the order they were written."""
    out: list[list[dict]] = []
    for r in records:
        if not out or r["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(r)
    return out


def spike_rows(record: dict) -> list[dict]:
    """The spikes the script saw (`result.json`'s ``spikes``), one row each: the step, which detector fired
    ('loss' or 'grad_norm'), both values and z-scores, the checkpoint it went back to (None: not rewound), the data
    positions skipped [first, end), the steps computed again, and the learning rate after it."""
    rows = []
    for e in record.get("spikes", []):
        skipped = e.get("batches_skipped")
        rows.append({"step": e["step"], "metric": e["metric"], "loss": e["loss"], "z_loss": e["z_loss"],
                     "grad_norm": e["grad_norm"], "z_grad_norm": e["z_grad_norm"],
                     "data_position": e.get("data_position"), "rewound_to": e.get("rewound_to"),
                     "skipped": tuple(skipped) if skipped else None,
                     "redone": (e["step"] - e["rewound_to"]) if e.get("rewound_to") is not None else 0,
                     "lr": e.get("lr")})
    return rows


def trend_rows(clean: list[dict], spiked: list[dict], step: int, metrics=("loss", "grad_norm"),
               windows=(6, 10, 14), warmup: int = 6) -> list[dict]:
    """A run's metrics replayed through two detectors at several windows: the plain window (`spikes.SpikeDetector`)
    and the detrended one (`spikes.DetrendedSpikeDetector`). ``clean``, ``spiked``: the metrics records of the same
    run without and with the spike, neither rewound (``spiked`` is read up to ``step``, the spike's). One row per
    (metric, window, detector): the z-score the spike gets, and the largest z-score over the clean run and the step
    it came at (how close the healthy run comes to a false alarm)."""
    from course_lib.training import spikes

    for records in (clean, spiked):
        if [r["step"] for r in records] != list(range(len(records))):
            raise ValueError("trend_rows: give the records of a run that was never rewound (steps 0, 1, 2, ...)")
    rows = []
    for metric in metrics:
        values = {"clean": [r[metric] for r in clean], "spiked": [r[metric] for r in spiked[:step + 1]]}
        for window in windows:
            for name, cls in (("plain window", spikes.SpikeDetector), ("detrended", spikes.DetrendedSpikeDetector)):
                settings = {"window": window, "warmup": min(warmup, window)}       # z: only the z-scores are read
                z_spike = spikes.replay_zscores(values["spiked"], cls(**settings))[step]
                z_clean = spikes.replay_zscores(values["clean"], cls(**settings))
                worst = max(range(len(z_clean)), key=z_clean.__getitem__)
                rows.append({"metric": metric, "window": window, "detector": name, "z_spike": z_spike,
                             "z_clean_max": z_clean[worst], "z_clean_max_step": worst})
    return rows


def final_loss(record: dict, last: int = 5) -> float:
    """The mean training loss of a run's last ``last`` steps (the surviving pass: `result.json`'s ``losses``)."""
    losses = [record["losses"][k] for k in sorted(record["losses"], key=int)]
    tail = losses[-last:]
    return sum(tail) / len(tail)


def stack_dump(run_dir: str | Path, rank: int, lines: int = 8) -> list[str]:
    """The stack Python's faulthandler wrote into rank ``rank``'s log when the watchdog stopped it with SIGABRT
    (``Fatal Python error: Aborted`` and the frames under it, innermost first): where the rank was stuck, what a
    flight recorder tells on GPUs. [] when the log holds none."""
    text = (Path(run_dir) / f"rank{rank}.log").read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith("Fatal Python error")), None)
    if start is None:
        return []
    out = [text[start]]
    for line in text[start + 1:]:
        if not line.strip():
            if len(out) > 2:                  # the blank line after the header, then the frames up to the next one
                break
            continue
        out.append(line.rstrip())
    return out[:lines]


def loader_resume(cfg: ModelConfig, global_batch: int = 8, before: int = 5, after: int = 3, seed: int = 0,
                  pad_fraction: float = 0.0) -> dict:
    """The training script's loader (`data.WindowLoader`) read for ``before`` batches, its ``state_dict`` taken
    (what a checkpoint stores), ``after`` more read; a new loader (a restarted process) restores the state and
    reads ``after`` batches. Returns {'state', 'same' (every restored batch equal, bit for bit), 'positions'
    (before, after), 'fresh_differs' (a loader that starts over reads other batches)}."""
    from course_lib.data import WindowLoader

    tokens = text_corpus(2_000_000).long() % cfg.vocab_size

    def loader():
        return WindowLoader(tokens, cfg.seq_len, global_batch, seed=seed, pad_fraction=pad_fraction)

    first = loader()
    for _ in range(before):
        first.next()
    state = dict(first.state_dict())
    want = [first.next() for _ in range(after)]
    resumed = loader()
    resumed.load_state_dict(state)
    got = [resumed.next() for _ in range(after)]
    fresh = loader().next()
    return {"state": state, "positions": (before, resumed.position),
            "same": all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got)),
            "fresh_differs": not torch.equal(fresh[0], want[0][0])}


def _rank_token_losses(cfg: ModelConfig, batches, accum: int, lr: float, rank_train) -> dict:
    """On each rank: ``rank_train`` (lesson 02's bucketed DDP) with `accum` micro-batches per step, once per loss
    normalisation ('tokens': summed loss / global valid tokens; 'mean': each micro-batch's mean / accum, DDP's mean
    over ranks), plus this rank's valid tokens per micro-batch of the first batch."""
    from course_lib.training.token_loss import IGNORE_INDEX

    r, n = dist.get_rank(), dist.get_world_size()
    y = shard_batch(batches[0][1], r, n)                                 # (B/n, T): this rank's rows
    valid = [int((m != IGNORE_INDEX).sum()) for m in y.chunk(accum)]
    out = {norm: rank_train(cfg, batches, mode="bucketed", lr=lr, bucket_cap_mb=0.01, accum_steps=accum,
                            loss_norm=norm) for norm in ("tokens", "mean")}
    return {**out, "valid": valid}


def token_loss_runs(cfg: ModelConfig, batches, rank_train, accum: int = 2, nprocs: int = 2, lr: float = 0.1,
                    timeout_s: float = 240.0) -> dict:
    """DP ``nprocs`` x gradient accumulation ``accum`` on right-padded ``batches`` (targets -100 past each row's
    length, so micro-batches and ranks hold different numbers of valid tokens: lesson 02's `padded_batches`),
    trained with SGD by lesson 02's ``rank_train`` (passed in: lessons share code only through modules below them)
    twice: dividing the summed loss by the global number of valid tokens, and averaging each micro-batch's mean;
    against one process on the same global batches (`one_process.train_reference`: its LM loss is the mean over the
    valid tokens). Returns {'valid' (valid tokens [[per micro-batch] per rank] of the first batch), 'reference'
    (one process), 'runs' {'tokens', 'mean': rank 0's}, 'loss_err' and 'grad_err' {'tokens', 'mean'} (largest
    relative difference from one process over the ranks: losses of every step, first-step gradients), 'formula'
    (the first step's mean of micro-batch means, from one process's model on each micro-batch), 'backend'}."""
    from course_lib.model import lm_loss
    from course_lib.one_process import train_reference

    ref = train_reference(cfg, batches, lr=lr)
    res = run(_rank_token_losses, nprocs, args=(cfg, batches, accum, lr, rank_train), backend="gloo", stream=False,
              timeout_s=timeout_s)
    model = build_model(cfg, 0)                          # the first step's micro-batches through one process's model
    x, y = batches[0]
    with torch.no_grad():
        means = [lm_loss(model(xm), ym).item() for xr, yr in zip(x.chunk(nprocs), y.chunk(nprocs))
                 for xm, ym in zip(xr.chunk(accum), yr.chunk(accum))]
    err: dict = {"loss_err": {}, "grad_err": {}}
    for norm in ("tokens", "mean"):
        err["loss_err"][norm] = max(abs(a - b) / abs(b) for out in res.returns
                                    for a, b in zip(out[norm]["losses"], ref["losses"]))
        err["grad_err"][norm] = max(relative_error(out[norm]["first_grads"], ref["first_grads"])
                                    for out in res.returns)
    return {"valid": [out["valid"] for out in res.returns], "reference": ref,
            "runs": {norm: res.returns[0][norm] for norm in ("tokens", "mean")}, **err,
            "formula": sum(means) / len(means), "backend": res.backend}
