"""Tests of lesson 09's distributed checkpoints (course_lib/parallel/dist_checkpoint.py).

A tiny training loop (the course's GPT with dropout 0.1, AdamW, a LambdaLR warm-up, data from `random_batches`,
each rank's own random streams) runs 6 steps uninterrupted; the same run saved after 3 steps and resumed in NEW
processes must give exactly the same losses and parameters (`torch.equal`), and resumes that forget the RNG
state, the schedule or the data position must not. Resharding (4 DDP ranks -> 2, DDP -> FSDP2) is compared
within fp32 rounding; DeepSpeed ZeRO-2 and an async save must resume bit-exactly. Three launches in all: the
first halves on 2 ranks, a save on 4 ranks, every resume in one fresh 2-rank launch.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.config import small_config
from course_lib.data import random_batches, shard_batch
from course_lib.dist import device
from course_lib.runtime.launch import run
from course_lib.lessons.errors import max_abs_error, relative_error
from course_lib.model import build_model, lm_loss
from course_lib.parallel import dist_checkpoint as ckpt
from course_lib.parallel.deepspeed_config import deepspeed_config, import_deepspeed

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value

CFG = small_config(dropout=0.1)          # dropout on: the ranks' random streams decide the result
CFG0 = small_config()                    # dropout off: for resumes on another world size (streams reseeded)
STEPS, HALF, GLOBAL_BATCH, LR = 6, 3, 8, 1e-2
BIG = small_config(vocab_size=256, seq_len=32, n_layer=4, n_head=4, d_model=256)   # ~3.2M parameters: timings


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 8)


def _seed_streams(rank: int) -> None:
    """Each rank's start-up streams (a new process would seed the same way)."""
    torch.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    np.random.seed(3000 + rank)


def _streams() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()[1].copy()}


def _build(cfg, kind: str = "ddp"):
    model = build_model(cfg, 0).to(device())
    if kind == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
    else:                                              # FSDP2: every block a unit, then the root
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        net = fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, net, opt, torch.optim.lr_scheduler.LambdaLR(opt, _warmup)


def _rows(batch):
    r, n = dist.get_rank(), dist.get_world_size()
    return [shard_batch(t, r, n).to(device()) for t in batch]


def _train(net, opt, sched, batches, start: int, stop: int) -> list[float]:
    losses = []
    for s in range(start, stop):
        x, y = _rows(batches[s])
        loss = lm_loss(net(x), y)                      # this rank's rows: (B/N, T) -> scalar
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    return losses


def _params(model) -> dict:
    full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p   # noqa: E731  (FSDP2: DTensor)
    return {k: full(p).detach().cpu().clone() for k, p in model.named_parameters()}


def _deepspeed(cfg):
    ds = import_deepspeed()
    model = build_model(cfg, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    conf = deepspeed_config(2, GLOBAL_BATCH // dist.get_world_size())       # ZeRO-2, fp32
    engine, _, _, _ = ds.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=conf)
    return model, engine


def _ds_train(engine, batches, start: int, stop: int) -> list[float]:
    losses = []
    for s in range(start, stop):
        x, y = _rows(batches[s])
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()                                  # also steps the schedule
        losses.append(loss.item())
    return losses


def _save_timings(root: str, repeats: int = 3) -> dict:
    """Seconds the loop is blocked by a save of BIG (params + AdamW state), synchronous vs async: lesson 09's
    measurement (`large_runs.rank_save_timing`), medians of `repeats`."""
    from course_lib.lessons.l09_training.large_runs import rank_save_timing

    t = rank_save_timing(BIG, f"{root}/timing", repeats)     # its own folders: root's sync/, async/ are for resumes
    return {**{k: statistics.median(t[k]) for k in ("sync_s", "async_blocked_s", "async_total_s")},
            "bytes": t["file_bytes"], "params": t["params"]}


def _first_halves(root: str, batches) -> dict:
    rank, out = dist.get_rank(), {}
    model, net, opt, sched = _build(CFG)                 # 6 steps, uninterrupted
    _seed_streams(rank)
    losses = _train(net, opt, sched, batches, 0, HALF)
    out["streams_at_half"] = _streams()
    losses += _train(net, opt, sched, batches, HALF, STEPS)
    out["ref"] = {"losses": losses, "params": _params(model)}
    for mode in ("sync", "async"):                      # 3 steps, save, go on training (async: while writing)
        model, net, opt, sched = _build(CFG)
        _seed_streams(rank)
        losses = _train(net, opt, sched, batches, 0, HALF)
        t0 = time.perf_counter()
        handle = ckpt.save(ckpt.step_path(f"{root}/{mode}", HALF), model=model, optimizer=opt, scheduler=sched,
                           step=HALF, data_position=HALF, seed=7, async_save=mode == "async")
        out[f"{mode}_blocked_s"] = time.perf_counter() - t0
        losses += _train(net, opt, sched, batches, HALF, STEPS)
        if handle is not None:
            handle.result()
        out[mode] = {"losses": losses, "params": _params(model)}
    model, net, opt, sched = _build(CFG0)                # no dropout: the reference of the resharded resume
    _seed_streams(rank)
    out["ref0"] = {"losses": _train(net, opt, sched, batches, 0, STEPS), "params": _params(model)}
    model, engine = _deepspeed(CFG)                     # DeepSpeed ZeRO-2: uninterrupted, and 3 steps + save
    _seed_streams(rank)
    out["ref_ds"] = {"losses": _ds_train(engine, batches, 0, STEPS), "params": _params(model)}
    model, engine = _deepspeed(CFG)
    _seed_streams(rank)
    _ds_train(engine, batches, 0, HALF)
    ckpt.save_deepspeed(engine, f"{root}/ds", HALF, HALF)
    out["timings"] = _save_timings(root)
    return out


def _save_on_four(root: str, batches) -> list[float]:
    model, net, opt, sched = _build(CFG0)
    _seed_streams(dist.get_rank())
    losses = _train(net, opt, sched, batches, 0, HALF)
    ckpt.save(ckpt.step_path(f"{root}/four", HALF), model=model, optimizer=opt, scheduler=sched, step=HALF,
              data_position=HALF)
    return losses


def _resume(cfg, kind, path, batches, scheduler=True, rng=True, position=True) -> dict:
    """A new run that loads ``path`` and trains 3 more steps; the flags make it forget one part of the state."""
    model, net, opt, sched = _build(cfg, kind)
    _seed_streams(dist.get_rank())                      # what a new process starts with
    state = ckpt.load(path, model=model, optimizer=opt, scheduler=sched if scheduler else None)
    if not rng:
        _seed_streams(dist.get_rank())                  # a loader without RNG: the start-up streams stay
    streams = _streams()
    start = state.data_position if position else 0
    losses = _train(net, opt, sched, batches, start, start + STEPS - HALF)
    return {"state": state, "streams": streams, "losses": losses, "params": _params(model)}


def _second_halves(root: str, batches) -> dict:
    out = {"sync": _resume(CFG, "ddp", ckpt.latest(f"{root}/sync"), batches)}   # first: a pristine process
    path = ckpt.step_path(f"{root}/sync", HALF)
    out["no-rng"] = _resume(CFG, "ddp", path, batches, rng=False)
    out["no-schedule"] = _resume(CFG, "ddp", path, batches, scheduler=False)
    out["no-position"] = _resume(CFG, "ddp", path, batches, position=False)
    out["async"] = _resume(CFG, "ddp", ckpt.latest(f"{root}/async"), batches)
    out["fsdp2"] = _resume(CFG, "fsdp2", path, batches)
    out["four"] = _resume(CFG0, "ddp", ckpt.latest(f"{root}/four"), batches)
    model, engine = _deepspeed(CFG)
    _seed_streams(dist.get_rank())
    state = ckpt.load_deepspeed(engine, f"{root}/ds")
    out["ds"] = {"state": state, "losses": _ds_train(engine, batches, state.data_position, STEPS),
                 "params": _params(model)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpoints"))
    batches = random_batches(CFG, GLOBAL_BATCH, STEPS)
    kw = dict(args=(root, batches), timeout_s=240, stream=False, backend="gloo")
    first = run(_first_halves, 2, **kw)
    four = run(_save_on_four, 4, **kw)
    second = run(_second_halves, 2, fresh=True, **kw)                    # new processes: nothing but the files
    print(f"launches: first halves {first.wall_s:.1f} s, 4 ranks {four.wall_s:.1f} s, resumes {second.wall_s:.1f} s")
    return {"root": root, "first": first.returns, "four": four.returns, "second": second.returns}


def _tail(run_out: dict) -> dict:
    """Losses of the last 3 steps and the final parameters."""
    return {"losses": run_out["losses"][-(STEPS - HALF):], "params": run_out["params"]}


def _exact(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])


def _rel(a: dict, b: dict) -> tuple[float, float]:
    loss = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
    return loss, relative_error(a["params"], b["params"])


def test_saving_does_not_change_training(runs):
    for out in runs["first"]:
        assert _exact(out["sync"], out["ref"]) and _exact(out["async"], out["ref"])


def test_resume_is_bit_exact(runs):
    for rank, (first, second) in enumerate(zip(runs["first"], runs["second"])):
        res = second["sync"]
        assert (res["state"].step, res["state"].data_position, res["state"].seed) == (HALF, HALF, 7)
        assert res["state"].rng_restored and res["state"].world_size == 2
        assert torch.equal(res["streams"]["torch"], first["streams_at_half"]["torch"]), f"rank {rank}: torch RNG"
        assert res["streams"]["python"] == first["streams_at_half"]["python"], f"rank {rank}: random"
        assert np.array_equal(res["streams"]["numpy"], first["streams_at_half"]["numpy"]), f"rank {rank}: numpy"
        assert _exact(res, _tail(first["ref"])), f"rank {rank}: resumed run differs: {_rel(res, _tail(first['ref']))}"


@pytest.mark.parametrize("broken", ["no-rng", "no-schedule", "no-position"])
def test_forgetful_resume_is_not_exact(runs, broken):
    for first, second in zip(runs["first"], runs["second"]):
        assert not _exact(second[broken], _tail(first["ref"])), f"{broken} resumed exactly: the test cannot fail"
        print(f"{broken}: loss, params relative difference {_rel(second[broken], _tail(first['ref']))}")


def test_async_checkpoint_resumes_bit_exactly(runs):
    for first, second in zip(runs["first"], runs["second"]):
        assert _exact(second["async"], _tail(first["ref"]))
    t, tiny = runs["first"][0]["timings"], runs["first"][0]
    print(f"save of {t['params'] / 1e6:.1f}M params + AdamW ({t['bytes'] / 1e6:.0f} MB on disk), 2 ranks, "
          f"2-core CPU, gloo: sync blocks {t['sync_s'] * 1e3:.0f} ms, async {t['async_blocked_s'] * 1e3:.0f} ms "
          f"(write done after {t['async_total_s'] * 1e3:.0f} ms); tiny model: sync "
          f"{tiny['sync_blocked_s'] * 1e3:.1f} ms, async {tiny['async_blocked_s'] * 1e3:.1f} ms")
    assert t["sync_s"] > 0 and t["async_blocked_s"] > 0 and t["bytes"] > 12 * t["params"]   # no timing targets


def test_resharding_4_to_2_ranks(runs):
    """4 ranks sum gradients in another order than 2 (and each rank averages 2 rows, not 4): the first 3 steps
    differ in the last bits, and Adam's m / (sqrt(v) + eps) turns last-bit differences of gradients near 0 into
    updates of ~1e-6 (measured: parameters 2e-6 apart, relative norm). Tolerance 2e-5 (losses 1e-5); a resume
    that lost the optimizer state or the schedule is off by ~lr = 1e-2 (`test_forgetful_resume_is_not_exact`)."""
    for rank, (first, second) in enumerate(zip(runs["first"], runs["second"])):
        res, ref = second["four"], _tail(first["ref0"])
        assert res["state"].world_size == 4 and not res["state"].rng_restored   # reseeded, by design
        loss_err, param_err = _rel(res, ref)
        worst = max_abs_error(res["params"], ref["params"])
        print(f"4 -> 2 ranks, rank {rank}: loss relative difference {loss_err:.1e}, parameters {param_err:.1e} "
              f"(largest element difference {worst:.1e})")
        assert loss_err < 1e-5 and param_err < 2e-5, f"rank {rank}: {loss_err:.1e}, {param_err:.1e}"


def test_ddp_checkpoint_into_fsdp2(runs):
    for rank, (first, second) in enumerate(zip(runs["first"], runs["second"])):
        res, ref = second["fsdp2"], _tail(first["ref"])
        assert res["state"].rng_restored                 # same world size: the streams continue
        loss_err, param_err = _rel(res, ref)
        print(f"DDP -> FSDP2, rank {rank}: loss relative difference {loss_err:.1e}, parameters {param_err:.1e}, "
              f"bit-exact: {_exact(res, ref)}")        # 2 ranks: a + b and (a + b) / 2 either way; NCCL may differ
        assert loss_err < 1e-5 and param_err < 2e-5


def test_deepspeed_resume_is_bit_exact(runs):
    for rank, (first, second) in enumerate(zip(runs["first"], runs["second"])):
        res, ref = second["ds"], _tail(first["ref_ds"])
        assert res["state"].step == HALF and res["state"].rng_restored
        assert _exact(res, ref), f"rank {rank}: {_rel(res, ref)}"
    assert ckpt.latest(f"{runs['root']}/ds").name == f"step_{HALF:06d}"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")      # one process, on purpose
def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """One process: a save that dies while writing leaves only its hidden temp folder; `latest` keeps the last
    complete checkpoint, which still loads."""
    model = build_model(CFG0, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.loss(*random_batches(CFG0, 2, 1)[0]).backward()
    opt.step()
    ckpt.save(ckpt.step_path(tmp_path, 1), model=model, optimizer=opt, step=1, data_position=1)

    def dies(state, checkpoint_id, **_):
        (checkpoint_id / "__0_0.distcp").write_bytes(b"half a file")
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(ckpt.dcp, "save", dies)
    with pytest.raises(RuntimeError, match="mid-save"):
        ckpt.save(ckpt.step_path(tmp_path, 2), model=model, optimizer=opt, step=2, data_position=2)
    assert (tmp_path / ".tmp-step_000002").is_dir() and ckpt.latest(tmp_path) == tmp_path / "step_000001"
    monkeypatch.undo()
    fresh = build_model(CFG0, 1)
    state = ckpt.load(ckpt.latest(tmp_path), model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=LR))
    assert state.step == 1 and all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
    assert ckpt.latest(tmp_path / "none") is None
