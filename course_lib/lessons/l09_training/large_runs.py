"""Lesson 09, second part: what goes wrong in large runs, measured on a small one.

    out = instability_runs()                        # plain, QK-norm, z-loss at a learning rate past the stable one
    fig = instability_figure(out, hardware_label())
    t = async_save_timing()                         # DCP save vs async_save: how long the training loop is blocked
    r = reshard_demo()                              # ZeRO-2 state written by 4 gloo ranks, loaded on 2, compared

1. Instability at a high learning rate. Dehghani et al. 2023 ("Scaling Vision Transformers to 22 Billion
   Parameters") traced a divergence to "extremely large values in attention logits, which lead to (almost one-hot)
   attention weights with near-zero entropy"; Wortsman et al. 2023 ("Small-scale proxies for large-scale
   Transformer training instabilities") showed the same attention-logit growth in small models trained at a high
   learning rate, which is what `instability_runs` does. Remedies measured: QK-norm (`ModelConfig.qk_norm`, a
   LayerNorm on each head's queries and keys, Dehghani et al.; OLMo 2 uses RMSNorm) and PaLM's z-loss
   (`course_lib.model.z_loss`, 1e-4 log^2 Z on the OUTPUT softmax). The summary says what each did here.
2. Checkpoints as large runs take them: `async_save_timing` times DCP's synchronous save against `async_save`
   (through `parallel.dist_checkpoint.save`, the training script's), and `reshard_demo` loads on 2 ranks a
   ZeRO-2 checkpoint written by 4 (`dist_checkpoint` + the ZeRO optimizer's `dcp_state_dict`, lesson 05's
   `parallel.zero`), checking every parameter and optimizer-state tensor bit for bit.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.config import ModelConfig
from course_lib.data import get_batch, random_batches, shard_batch, text_corpus
from course_lib.runtime.launch import run
from course_lib.model import build_model, lm_loss, max_attention_logit, track_attention_logits, z_loss
from course_lib.parallel import dist_checkpoint

__all__ = ["INSTABILITY_CFG", "SAVE_CFG", "instability_runs", "instability_figure", "bf16_spacing",
           "async_save_timing", "reshard_demo"]

# the settings measured on a 2-core AMD EPYC (torch 2.14, 2 threads): see `instability_runs`
INSTABILITY_CFG = ModelConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64, name="instability")
SAVE_CFG = ModelConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=8, d_model=384, name="save-timing")  # 7.2M
VARIANTS = ("plain", "qk_norm", "z_loss")


# ----------------------------------------------------------------------------- 1. instability

def bf16_spacing(x: float) -> float:
    """The gap between neighbouring bfloat16 numbers near |x| (8 significant bits: 2^(floor(log2|x|) - 7)):
    how coarsely a logit of that size is stored in bf16."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 0.0


def instability_runs(cfg: ModelConfig | None = None, lr: float = 3e-2, steps: int = 150, batch: int = 16,
                     seed: int = 0, variants: tuple[str, ...] = VARIANTS, z_loss_coef: float = 1e-4) -> dict:
    """Train the course's GPT in this process past its stable learning rate, once per variant: 'plain',
    'qk_norm' (`cfg.replace(qk_norm=True)`) and 'z_loss' (the loss + z_loss_coef x log^2 Z); the same
    initial weights (but QK-norm's own), data (bytes of the offline corpus, `data.get_batch`) and seed each time.
    AdamW (betas 0.9, 0.95, no weight decay), constant lr, no warm-up, no clipping: nothing hides the instability.

    Records per step: 'losses' (the LM loss, without the z-loss term), 'max_logits' (the largest attention logit
    q.k/sqrt(D) of any layer and head, `model.max_attention_logit`), 'log_z' (root mean square of log Z of the
    output softmax); and 'seconds'. Returns {'runs': {variant: record}, 'settings': {...}, 'summary': str}.

    Measured on a 2-core AMD EPYC, torch 2.14, 2 threads, with the defaults (INSTABILITY_CFG: 2 layers, 2 heads,
    d_model 64, T 64; lr 3e-2, 150 steps, batch 16), 2.7 s per variant: plain's largest logit grows from 0.1 to
    ~1950 and its loss stalls near 3.06 nats (mean of the last 20 steps); QK-norm keeps it at or below 10 (195x
    less) and reaches 2.78; z-loss at 1e-4 does not stop the growth (1720, 1.1x less than plain; loss 2.90; rms
    log Z 5.26 against plain's 5.46). With 1 thread the numbers move (the run is chaotic at this lr) but not the
    picture: plain ~2200, QK-norm ~12, z-loss ~2400. Plain at lr 1e-2: ~110; at 1e-1: ~55000 (QK-norm ~50 there:
    it too has a limit).
    """
    cfg = cfg or INSTABILITY_CFG
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"variants {sorted(unknown)} are unknown: pick from {VARIANTS}")
    tokens = text_corpus(2_000_000).long() % cfg.vocab_size
    out = {}
    for variant in variants:
        t0 = time.perf_counter()
        model = build_model(cfg.replace(qk_norm=variant == "qk_norm"), seed)
        track_attention_logits(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        rec = {"losses": [], "max_logits": [], "log_z": []}
        for step in range(steps):
            x, y = get_batch(tokens, batch, cfg.seq_len, step, seed=seed)       # (B, T) each
            logits = model(x)                                                   # (B, T, V)
            loss = lm_loss(logits, y)
            total = loss + z_loss_coef * z_loss(logits) if variant == "z_loss" else loss
            total.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec["losses"].append(loss.item())
            rec["max_logits"].append(max_attention_logit(model))
            rec["log_z"].append(torch.logsumexp(logits.detach().float(), -1).square().mean().sqrt().item())
        rec["seconds"] = time.perf_counter() - t0
        out[variant] = rec
    settings = {"cfg": cfg, "lr": lr, "steps": steps, "batch": batch, "seed": seed, "z_loss_coef": z_loss_coef,
                "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0), constant lr, no clipping"}
    return {"runs": out, "settings": settings, "summary": _summary(out, settings)}


def _tail_mean(values: list[float], n: int = 20) -> float:
    tail = values[-n:]
    return sum(tail) / len(tail)


def _summary(runs: dict, settings: dict) -> str:
    """What the runs measured, in sentences built from the numbers (no claim the numbers do not show)."""
    lines = [f"lr {settings['lr']:g}, {settings['steps']} steps, {settings['optimizer']}:"]
    for v, rec in runs.items():
        lines.append(f"  {v:8s} largest attention logit {max(rec['max_logits']):9.1f} (last step "
                     f"{rec['max_logits'][-1]:9.1f}); loss, mean of the last 20 steps {_tail_mean(rec['losses']):.3f} "
                     f"nats; rms log Z {_tail_mean(rec['log_z']):.2f}; {rec['seconds']:.1f} s")
    if "plain" in runs:
        peak = max(runs["plain"]["max_logits"])
        gap = bf16_spacing(peak)
        lines.append(f"  bf16 numbers near {peak:.0f} are {gap:g} apart: each logit that large is rounded by up to "
                     f"{gap / 2:g}, a difference l - l_max by up to {gap:g}, so a softmax weight e^(l - l_max) "
                     f"computed from bf16 logits can be off by a factor up to e^{gap:g} = {math.exp(gap):.3g}.")
        for v in ("qk_norm", "z_loss"):
            if v in runs:
                factor = peak / max(runs[v]["max_logits"])
                dloss = _tail_mean(runs[v]["losses"]) - _tail_mean(runs["plain"]["losses"])
                verdict = ("keeps the attention logits bounded" if factor > 10 else
                           "does not keep the attention logits from growing")
                lines.append(f"  {v}: {verdict} (plain's largest / {v}'s largest = {factor:.1f}x); "
                             f"loss {dloss:+.3f} nats against plain.")
        if "z_loss" in runs:
            lines.append("  z-loss acts on the output softmax's log Z, not on attention: at "
                         f"{settings['z_loss_coef']:g} (PaLM's coefficient) it changed log Z by "
                         f"{_tail_mean(runs['z_loss']['log_z']) - _tail_mean(runs['plain']['log_z']):+.2f} here. "
                         "It guards against a drift of the output logits, a different failure from this one.")
    return "\n".join(lines)


def instability_figure(runs: dict, hardware: str):
    """Left: the largest attention logit per step (log scale) for each variant; right: the loss per step."""
    import matplotlib.pyplot as plt

    recs, settings = runs.get("runs", runs), runs.get("settings", {})
    styles = {"plain": ("C3", "-", "plain"), "qk_norm": ("C0", "-", "QK-norm"), "z_loss": ("C2", "--", "z-loss 1e-4")}
    fig, (ax, lx) = plt.subplots(1, 2, figsize=(10, 3.4))
    for v, rec in recs.items():
        color, ls, label = styles.get(v, ("k", ":", v))
        ax.plot(rec["max_logits"], color=color, ls=ls, lw=1.4, label=label)
        lx.plot(rec["losses"], color=color, ls=ls, lw=1.2, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("largest attention logit q.k / sqrt(D)")
    lr = f"lr {settings['lr']:g}, " if "lr" in settings else ""
    ax.set_title(f"attention-logit growth, {lr}AdamW ({hardware})", fontsize=9)
    ax.legend(fontsize=7)
    lx.set_xlabel("step")
    lx.set_ylabel("training loss (nats)")
    lx.set_ylim(top=min(6.0, max(max(r["losses"][1:]) for r in recs.values()) + 0.2))
    lx.set_title("loss", fontsize=9)
    lx.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- 2. checkpoints

def rank_save_timing(cfg: ModelConfig, root: str, repeats: int, steps: int = 3) -> dict:
    """On every rank: a DDP model with its AdamW state, saved `repeats` times synchronously and asynchronously,
    interleaved. Blocked = from the call until it returns (the loop could go on); total = until the writer thread's
    write ended (its future done; `handle.result()` then publishes the folder). Each repeat also times `steps` training steps
    with no save in flight ('step_s') and the same number right after the async save returned, while its thread
    writes ('step_during_s'; 'written_during': whether the write had finished by the end of those steps)."""
    model = build_model(cfg, 0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (shard_batch(t, dist.get_rank(), dist.get_world_size()) for t in random_batches(cfg, 4, 1)[0])

    def train_steps(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            lm_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - t0) / max(n, 1)

    train_steps(1)                                      # AdamW's m and v exist: the state a run saves
    group = dist.new_group(backend="gloo")              # the async writer's own group, made once as a loop would
    sync, blocked, total, alone, during, written = [], [], [], [], [], []
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist_checkpoint.save(dist_checkpoint.step_path(f"{root}/sync", i), model=model, optimizer=opt, step=i,
                             data_position=i)
        sync.append(time.perf_counter() - t0)
        dist.barrier()
        alone.append(train_steps(steps))
        dist.barrier()
        t0 = time.perf_counter()
        handle = dist_checkpoint.save(dist_checkpoint.step_path(f"{root}/async", i), model=model, optimizer=opt,
                                      step=i, data_position=i, async_save=True, process_group=group)
        blocked.append(time.perf_counter() - t0)
        ended: list[float] = []
        handle.future.add_done_callback(lambda _: ended.append(time.perf_counter()))
        during.append(train_steps(steps))
        written.append(handle.future.done())
        handle.result()
        while not ended:                                # the callback runs in the writer's thread
            time.sleep(1e-3)
        total.append(ended[0] - t0)
    files = list(dist_checkpoint.latest(f"{root}/sync").iterdir())
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor))
    return {"sync_s": sync, "async_blocked_s": blocked, "async_total_s": total, "step_s": alone,
            "step_during_s": during, "written_during": written, "steps": steps, "state_bytes": state_bytes,
            "file_bytes": sum(f.stat().st_size for f in files), "params": sum(p.numel() for p in model.parameters())}


def async_save_timing(cfg: ModelConfig | None = None, nprocs: int = 2, repeats: int = 3,
                      folder: str | Path | None = None, timeout_s: float = 240) -> dict:
    """Time DCP's synchronous save against `async_save` on `nprocs` gloo ranks, for a model with its AdamW state
    (default SAVE_CFG: 7.2M parameters, 87 MB of state on each rank), both through the training script's
    `dist_checkpoint.save`, and training steps with and without an async write in flight (`rank_save_timing`).
    Returns rank 0's {'sync_s', 'async_blocked_s', 'async_total_s', 'step_s', 'step_during_s' (medians, s),
    'times' (every repeat), 'written_during' (every repeat), 'steps', 'state_bytes', 'file_bytes', 'params',
    'nprocs'}; the checkpoints are deleted (folder=None: a temporary one)."""
    cfg = cfg or SAVE_CFG
    root = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="async_save_"))
    try:
        res = run(rank_save_timing, nprocs, args=(cfg, str(root), repeats), backend="gloo", stream=False,
                  timeout_s=timeout_s).returns[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    times = {k: res[k] for k in ("sync_s", "async_blocked_s", "async_total_s", "step_s", "step_during_s")}
    return {**{k: statistics.median(v) for k, v in times.items()}, "times": times, "nprocs": nprocs,
            **{k: res[k] for k in ("written_during", "steps", "state_bytes", "file_bytes", "params")}}


def _rank_zero_state(cfg: ModelConfig, folder: str, steps: int, save: bool) -> dict:
    """4 ranks (save=True): train `steps` steps with the course's ZeRO-2 AdamW and save with `dist_checkpoint`.
    2 ranks (save=False): build the same optimizer from other weights and load. Either way return the full
    parameters and the full optimizer state, gathered (collectives: every rank calls them)."""
    from torch.distributed.tensor import DTensor

    from course_lib.parallel.zero import apply_zero

    r, n = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg, seed=0 if save else 1)
    zero = apply_zero(model, torch.optim.AdamW, stage=2, lr=1e-2)
    path = dist_checkpoint.step_path(folder, steps)
    if save:
        for x, y in random_batches(cfg, 8, steps):
            model.loss(shard_batch(x, r, n), shard_batch(y, r, n)).backward()
            zero.step()
            zero.zero_grad()
        dist_checkpoint.save(path, model=model, optimizer=zero, step=steps, data_position=steps)
    else:
        dist_checkpoint.load(path, model=model, optimizer=zero)
    state = {f"{name}.{k}": (v.full_tensor() if isinstance(v, DTensor) else torch.as_tensor(v)).clone()
             for name, entry in zero.dcp_state_dict(model)["state"].items() for k, v in entry.items()}
    return {"params": zero.full_parameters(model), "optim": state, "world_size": n,
            "shard_numel": sum(c.numel() for c in zero.chunks)}


def reshard_demo(cfg: ModelConfig | None = None, steps: int = 2, folder: str | Path | None = None,
                 timeout_s: float = 240) -> dict:
    """A ZeRO-2 checkpoint written by 4 gloo ranks (each its own shard of AdamW's state, as DCP pieces) and loaded
    on 2 (each reads the pieces of its new, twice larger shard). Returns {'saved', 'loaded' (rank 0's full
    parameters and optimizer state, each {'params', 'optim'}), 'equal' (every tensor bit for bit, on every loading
    rank), 'max_abs_diff', 'n_tensors', 'shard_numel' {4: ..., 2: ...}, 'seconds'}."""
    from course_lib.config import small_config

    cfg = cfg or small_config()
    root = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="reshard_"))
    t0 = time.perf_counter()
    try:
        kw = dict(backend="gloo", stream=False, timeout_s=timeout_s)
        saved = run(_rank_zero_state, 4, args=(cfg, str(root), steps, True), **kw).returns[0]
        loaded = run(_rank_zero_state, 2, args=(cfg, str(root), steps, False), **kw).returns
    finally:
        shutil.rmtree(root, ignore_errors=True)
    pairs = [(saved[part][k], rank_out[part][k]) for rank_out in loaded for part in ("params", "optim")
             for k in saved[part]]
    keys_match = all(rank_out[p].keys() == saved[p].keys() for rank_out in loaded for p in ("params", "optim"))
    equal = keys_match and all(torch.equal(a, b) for a, b in pairs)
    diff = max(float((a.double() - b.double()).abs().max()) if a.numel() else 0.0 for a, b in pairs)
    return {"saved": saved, "loaded": loaded[0], "equal": equal, "max_abs_diff": diff,
            "n_tensors": len(saved["params"]) + len(saved["optim"]),
            "shard_numel": {4: saved["shard_numel"], 2: loaded[0]["shard_numel"]},
            "seconds": time.perf_counter() - t0}
