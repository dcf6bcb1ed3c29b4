"""Lesson 09, second part: the training script when a large run goes wrong (course_lib/training/spikes.py, watchdog.py,
train.py, command.py, data.WindowLoader).

- The z-score spike detector: warm-up, window, a spike kept out of the window, non-finite values, its state.
- Configs that cannot apply are refused before launch, naming the field.
- Real runs on 2 gloo ranks: a poisoned batch is the one spike detected, rewound and skipped, and the run ends near
  the clean run on the same evaluation tokens; the rewind is exact (a fresh job that loads the checkpoint it went
  back to, saved again with the loader past the skipped batches, continues bit-exactly: the loader's position, not
  the step, is restored); a hung rank is named by the
  watchdog within timeout + poll interval, stopped, and the job completes from its checkpoint; padded batches on
  DP 2 x accumulation 2 give the loss of one process over the same tokens, and the per-micro-batch mean does not.
"""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest
import torch

from course_lib.training import command
from course_lib.config import ConfigError
from course_lib.data import WindowLoader
from course_lib.training.spikes import SpikeDetector
from course_lib.training.config import load_config
from course_lib.training.watchdog import Heartbeat, Watchdog

SPIKE = "configs/tiny_spike.toml"
HANG = "configs/tiny_hang.toml"
TINY = "configs/tiny_ddp.toml"


# ------------------------------------------------------------------------------ the detector (one process)

def test_detector_warmup_window_and_spikes_kept_out():
    det = SpikeDetector(window=5, warmup=3, z=3.0)
    assert [det.update(v) for v in (1.0, 100.0)] == [False, False]           # no verdict before 3 accepted values
    det = SpikeDetector(window=5, warmup=3, z=3.0)
    base = [1.0, 1.1, 0.9, 1.0, 1.05]
    assert not any(det.update(v) for v in base)
    mean, std = sum(base) / 5, torch.tensor(base).std().item()
    assert det.zscore(1.3) == pytest.approx((1.3 - mean) / std)               # sample std over the window
    assert det.update(5.0) and det.last_z > 3                                 # a spike...
    assert list(det.values) == base                                           # ...is not added to the window
    assert det.update(4.0), "a second spike right after the first must be seen (the first kept out of the window)"
    assert det.update(float("nan")) and det.update(float("inf")) and det.last_z == math.inf
    assert not det.update(0.2), "only upward moves are spikes"
    det.update(1.0)
    assert list(det.values) == [0.9, 1.0, 1.05, 0.2, 1.0]                     # the last `window` accepted values
    again = SpikeDetector(window=5, warmup=3, z=3.0)
    again.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert list(again.values) == list(det.values) and again.update(9.0) == det.update(9.0)
    with pytest.raises(ValueError, match="window=5"):
        SpikeDetector(window=4, warmup=3, z=3.0).load_state_dict(det.state_dict())


def test_a_detector_that_lets_spikes_into_its_window_misses_the_next_one():
    """The wrong variant (every value into the window) widens its band after one spike and misses a second."""
    values = [1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 0.95, 5.0, 4.0]
    det = SpikeDetector(window=8, warmup=4, z=4.0)
    right = [det.update(v) for v in values]
    wrong_window: list[float] = []
    wrong = []
    for v in values:
        ref = SpikeDetector(window=8, warmup=4, z=4.0)
        ref.values.extend(wrong_window[-8:])
        wrong.append(ref.zscore(v) > 4.0)
        wrong_window.append(v)
    assert right[-2:] == [True, True] and wrong[-2:] == [True, False]


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=1), "window=1"), (dict(warmup=1), "warmup=1"), (dict(window=5, warmup=6), "warmup=6 exceeds"),
    (dict(z=0), "z=0"), (dict(z=float("nan")), "z=nan"), (dict(window=2.5), "window=2.5")])
def test_detector_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpikeDetector(**kwargs)


# ------------------------------------------------------------------------------ the loader and the watchdog

def test_window_loader_position_skip_and_state():
    tokens = torch.arange(1001)                                               # token i at offset i
    a = WindowLoader(tokens, seq_len=10, global_batch=4, seed=3)
    assert a.n_windows == 100 and a.batches_per_epoch == 25
    first = [a.next()[0] for _ in range(30)]                                  # into the second epoch
    assert a.position == 30 and (a.epoch, a.batch) == (1, 5)
    seen = torch.cat(first[:25]).reshape(-1, 10)[:, 0] // 10                  # window index of each row, epoch 0
    assert sorted(seen.tolist()) == list(range(100)), "an epoch visits every window once"
    b = WindowLoader(tokens, seq_len=10, global_batch=4, seed=3)
    b.skip(7)
    assert torch.equal(b.next()[0], first[7])
    c = WindowLoader(tokens, seq_len=10, global_batch=4, seed=3)
    c.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert torch.equal(c.next(1, 2)[0], a.next()[0][2:]), "rank 1 of 2 gets rows 2..3 of the same global batch"
    with pytest.raises(ValueError, match="seed=3"):
        WindowLoader(tokens, 10, 4, seed=4).load_state_dict(a.state_dict())
    x, y = WindowLoader(tokens, 10, 4, pad_fraction=0.5).next()
    pad = y == -100
    assert pad.any() and not pad[:, :5].any() and torch.equal(x[pad], torch.zeros_like(x[pad]))


def test_watchdog_blames_the_rank_that_got_least_far(tmp_path):
    now = time.time()
    for rank, step, phase, ago in [(0, 7, "sync", 2.0), (1, 7, "start", 3.5), (2, 7, "sync", 2.1)]:
        Heartbeat(tmp_path, rank, attempt=0)(step, phase)
        path = tmp_path / f"rank{rank}.json"
        beat = json.loads(path.read_text()) | {"time": now - ago}
        path.write_text(json.dumps(beat))
    dog = Watchdog(tmp_path, 3, timeout_s=3.0)
    assert dog.poll(now - 1.0) is None                                        # rank 1 quiet 2.5 s < 3 s
    stall = dog.poll(now)
    assert (stall.rank, stall.step, stall.waiting) == (1, 7, (0, 2)) and stall.seconds == pytest.approx(3.5)
    assert "rank 1 stopped making progress at step 7" in str(stall)
    assert dog.poll(now + 10) is None, "an attempt is judged once"


# ------------------------------------------------------------------------------ refused before launch

@pytest.mark.parametrize("config, overrides, field", [
    (SPIKE, {"fault.step": 40}, "fault.step: 40 is past the run's end"),
    (SPIKE, {"fault.kind": "lr_jump", "fault.step": 29}, "fault.step: 29 is past the run's end"),
    (SPIKE, {"checkpoint.interval": 0}, "spikes.rewind: a rewind goes back to a checkpoint"),
    (SPIKE, {"checkpoint.interval": 14}, "checkpoint.interval: the first checkpoint (step 14) comes after step 14"),
    (SPIKE, {"checkpoint.keep": 1, "spikes.min_steps_back": 5}, "checkpoint.keep: 1 checkpoints every 4 steps"),
    (SPIKE, {"fault.step": 5}, "before the detector's warm-up of spikes.warmup = 6"),
    (HANG, {"watchdog.timeout_s": 0.5}, "watchdog.timeout_s: 0.5 s is not longer than a step"),
    (HANG, {"watchdog.step_seconds": 0.0}, "watchdog.step_seconds: declare how long a healthy step takes"),
])
def test_configs_that_cannot_apply_are_refused_naming_the_field(config, overrides, field, capsys):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
        command.check(config, 2, overrides)
    sets = [f"--set={k}={json.dumps(v)}" for k, v in overrides.items()]
    assert command.main(["--config", config, "--check", "--nprocs", "2", *sets]) == 2
    assert field.split(":")[0] in capsys.readouterr().err
    command.check(config, 2)                                                  # the configs as shipped are valid


# ------------------------------------------------------------------------------ real runs (2 gloo ranks)

def _run(tmp_path, config, name, nprocs=2, max_restarts=0, on_poll=None, **overrides):
    sets = {"job.name": name, "job.out_dir": str(tmp_path / name), **overrides}
    return command.launch(config, nprocs, sets, max_restarts=max_restarts, stream=False, timeout_s=300,
                          on_poll=on_poll)


def _checkpoint(path):
    """Everything a checkpoint of `train` holds, flat: {'model.tok_emb.weight': tensor, ...,
    'train_state.extra.rewinds': 1, 'rng.rng_rank0.torch': tensor, ...} (DCP's files read in this process, its JSON
    train state unpacked, every rank's generators)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.parent / f"{path.name}.pt")
    state = torch.load(path.parent / f"{path.name}.pt", weights_only=False)
    state["train_state"] = json.loads(state["train_state"])
    state["rng"] = {p.stem: torch.load(p, weights_only=False) for p in sorted(path.glob("rng_rank*.pt"))}
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict) or (isinstance(value, (list, tuple)) and value and isinstance(value[0], dict)):
            for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value
    walk("", state)
    return flat


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if hasattr(a, "__array__") or hasattr(b, "__array__"):                  # numpy's generator state
        import numpy as np
        return np.array_equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_poisoned_batch_is_the_one_spike_rewound_exactly_and_a_job_resumed_after_it_is_bit_exact(tmp_path):
    """The config as the lesson runs it (30 steps): the poisoned batch is the one spike and the recovered run ends
    near the clean one; the rewind is exact (a fresh job loading the checkpoint it went
    back to continues bit-exactly, from a loader position, 15, that is not its step, 12). A job that torchrun restarts
    after a SIGKILL resumes bit-exactly: tests/test_train.py."""
    keep = {"checkpoint.keep": 100}                                           # step 12's checkpoints stay, for below
    _, clean = _run(tmp_path, SPIKE, "clean", **keep, **{"fault.kind": ""})
    _, rec = _run(tmp_path, SPIKE, "recovered", **keep)
    print("eval loss (2 gloo ranks, CPU): clean", clean["eval_loss"], "recovered", rec["eval_loss"])
    assert clean["spikes"] == [], "a clean run must not be called spiky"
    assert len(rec["spikes"]) == 1, f"the injected spike must be the only one: {rec['spikes']}"
    first = rec["spikes"][0]
    assert (first["step"], first["data_position"]) == (14, 14) and "loss" in first["metric"] and first["z_loss"] > 6
    assert first["rewound_to"] == 12 and first["batches_skipped"] == [12, 15]
    assert first["discarded_losses"]["14"] > clean["losses"]["14"] + 2       # the spike, kept for the plot
    assert rec["data_positions"]["12"] == 15, "after the rewind step 12 reads the batch after the poisoned one"
    assert list(rec["losses"]) == [str(s) for s in range(30)] and rec["losses"]["14"] < clean["losses"]["14"] + 0.5
    assert abs(rec["eval_loss"] - clean["eval_loss"]) < 0.01, "the recovered run ends near the clean one"
    # The rewind is exact: what the process holds after it is the checkpoint of step 12 as first written (the clean
    # run's: the same history until then) but for the loader's position and the rewind count (the rewind saves it
    # again: a load that missed a piece would show here), and a fresh job given only that checkpoint continues as the
    # recovering process did (nothing the checkpoint lacks carried over). A wrong position fails this (the checkpoint
    # as first written, at 12, gives the clean run's step-12 loss).
    step12 = "checkpoints/step_000012"
    first_written, rewritten = _checkpoint(tmp_path / "clean" / step12), _checkpoint(tmp_path / "recovered" / step12)
    moved = {"data_position": 15, "rewinds": 1, "batch": 15}
    assert first_written.keys() == rewritten.keys() and len(first_written) > 100
    differ = {k for k in first_written if not _same(first_written[k], rewritten[k])}
    assert {k.split(".")[-1] for k in differ} == set(moved) and all(rewritten[k] == moved[k.split(".")[-1]]
                                                                   for k in differ), differ
    fresh = tmp_path / "fresh" / step12
    shutil.copytree(tmp_path / "recovered" / step12, fresh)
    _, again = _run(tmp_path, SPIKE, "fresh")
    assert again["resumed_from"] == [12] and again["data_positions"]["12"] == 15
    assert rec["losses"]["12"] != clean["losses"]["12"]
    assert again["losses"] == {k: v for k, v in rec["losses"].items() if int(k) >= 12}
    assert again["final_params"] == rec["final_params"], "the rewind is not what a fresh load of its checkpoint gives"


def test_a_hung_rank_is_named_stopped_and_the_job_resumes_from_its_checkpoint(tmp_path, capsys):
    timeout, poll = 8.0, 0.25      # a healthy rank inside a checkpoint save on a loaded CI machine was silent 4.1 s
    _, rec = _run(tmp_path, HANG, "hang", max_restarts=1,
                  **{"watchdog.timeout_s": timeout, "watchdog.poll_s": poll})
    (hang,) = rec["hangs"]
    assert (hang["rank"], hang["step"], hang["waiting"]) == (1, 7, [0])
    # bounded by the setting + the poll (+ 2 s for a loaded CI machine whose watching process waits for a core)
    assert timeout < hang["seconds"] <= timeout + poll + 2.0, hang
    assert "watchdog: rank 1 stopped making progress at step 7" in capsys.readouterr().out
    assert rec["restarts"] == 1 and rec["resumed_from"] == [6] and list(rec["losses"]) == [str(s) for s in range(10)]
    assert all(math.isfinite(v) for v in rec["losses"].values())


def test_padded_batches_on_dp2_x_accum2_give_one_process_loss_and_the_micro_batch_mean_does_not(tmp_path):
    common = {"data.pad_fraction": 0.6, "schedule.steps": 3, "schedule.warmup_steps": 1, "checkpoint.interval": 0,
              "logging.alerts": False,
              "data.global_batch": 8, "data.micro_batch": 2}
    _, one = _run(tmp_path, TINY, "one", nprocs=1, **common)                 # 1 rank x 4 micro-batches
    _, dp = _run(tmp_path, TINY, "dp", **common)                              # 2 ranks x 2 micro-batches
    _, mean = _run(tmp_path, TINY, "mean", **common, **{"data.loss": "micro_batch_mean"})
    assert one["layout"]["accum"] == 4 and dp["layout"] == {"dp": 2, "tp": 1, "pp": 1, "accum": 2}
    for s in map(str, range(3)):
        assert dp["losses"][s] == pytest.approx(one["losses"][s], rel=2e-6, abs=0)
    gap = abs(mean["losses"]["0"] - one["losses"]["0"])
    print(f"step 0 loss, 2 gloo ranks x 2 micro-batches, 60 % padding: per-micro-batch mean {mean['losses']['0']:.6f}"
          f" vs global tokens {one['losses']['0']:.6f}: differ by {gap:.2e}")
    assert gap > 1e-3
    assert mean["losses"]["2"] != pytest.approx(one["losses"]["2"], rel=1e-5)
