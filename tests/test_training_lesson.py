"""Lesson 09's experiment and report helpers (course_lib/lessons/l09_training/experiments.py, report.py): the rate
comparisons, the spike measure, the time-lost reading of a restarted run's metrics, torchrun's death lines, the
warm-up runs' bookkeeping. One process, no launches, a few seconds."""

from __future__ import annotations

import inspect
import math

import pytest

from course_lib.config import ModelConfig
from course_lib.lessons.l09_training import experiments, report
from course_lib.theory import practice


def test_lr_curves_agree_where_the_schedules_are_the_same():
    curves = experiments.lr_curves(3e-3, 10, 60, 3e-4, deepspeed=False)
    assert report.max_relative_difference(curves["lambda"], curves["ours"]) < 1e-12
    assert report.max_relative_difference(curves["torch"], curves["ours"]) < 1e-12
    assert max(curves["ours"]) == 3e-3 and curves["ours"][9] == 3e-3               # the peak once, at W - 1
    assert report.max_relative_difference(curves["warmup_constant"], curves["ours"]) > 0.1
    assert report.max_relative_difference([0.0, 1.0], [0.0, 1.0]) == 0.0
    assert report.max_relative_difference([1e-9], [0.0]) == math.inf                # an expected 0 must be 0
    with pytest.raises(ValueError, match="compare the same steps"):
        report.max_relative_difference([1.0], [1.0, 2.0])


def test_loss_spike_is_the_worst_later_loss_over_the_first():
    assert report.loss_spike([5.0, 4.0, 3.0]) == 0.8
    assert report.loss_spike([5.0, 4.0, 10.0, 3.0]) == 2.0
    assert report.loss_spike([5.0, float("nan")]) == math.inf
    with pytest.raises(ValueError):
        report.loss_spike([5.0])


def test_warmup_runs_share_model_data_and_seed():
    cfg = ModelConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=16, name="t")
    runs = experiments.warmup_runs(cfg, peak_lr=1e-2, warmup_steps=3, steps=4, batch=2)
    assert set(runs) == {0, 3}
    assert runs[0]["losses"][0] == runs[3]["losses"][0]                 # same model, same first batch
    assert runs[0]["lrs"][0] == pytest.approx(1e-2) and runs[3]["lrs"][0] == pytest.approx(1e-2 / 3)
    assert all(len(r["losses"]) == len(r["grad_norms"]) == 4 for r in runs.values())


def _records(steps, t0=100.0, step_s=0.1, save_after=(), save_s=0.0):
    out, t = [], t0
    for s in steps:
        t += step_s + (save_s if s - 1 in save_after else 0.0)
        out.append({"step": s, "time": t, "step_s": step_s})
    return out


def test_time_lost_reads_both_attempts():
    first = _records(range(0, 8))                                       # finished steps 0..7, killed in step 8
    second = _records(range(5, 12), t0=first[-1]["time"] + 10.0)        # 10 s later: resumed from checkpoint 5
    lost = experiments.time_lost(first + second)
    assert (lost["last_before"], lost["resumed_at"], lost["redone"]) == (7, 5, 3)
    assert lost["lost_s"] == pytest.approx(10.0 + 3 * 0.1)
    assert lost["redo_s"] == pytest.approx(0.3) and lost["restart_s"] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="no restart"):
        experiments.time_lost(first)


def test_step_times_find_the_checkpoint_saves():
    recs = _records(range(20), save_after=(4, 9, 14), save_s=0.5)
    got = experiments.step_times(recs)
    assert got["step_s"] == pytest.approx(0.1) and got["save_s"] == pytest.approx(0.5)
    assert experiments.step_times(_records(range(5)))["save_s"] == 0.0


def test_torchrun_failures_name_the_signal(tmp_path):
    (tmp_path / "launcher.log").write_text(
        "W1124 api.py:1028] Sending process 1725 closing signal SIGTERM\n"
        "E1124 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 1726) of binary: /x/python\n")
    assert experiments.torchrun_failures(tmp_path) == [
        "torchrun: local_rank 1 (pid 1726) failed, exitcode -9 = SIGKILL"]


def test_tables_and_the_waste_curve():
    from course_lib.training.alerts import SEED_RULES

    table = report.rules_table(SEED_RULES)
    assert "loss_nan" in table and "at once" in table and "10 min" in table
    m = practice.job_mtbf(50_000 * 3600, 1000)
    tau = practice.young_daly_interval(60.0, m)
    waste = report.waste_curve([tau / 2, tau, 2 * tau], 60.0, m, 300.0)
    assert waste[1] < waste[0] and waste[1] < waste[2]
    row = {"gpu": "A100", "peak": 312e12, "mfu": 0.4, "gpu_hours": 1024 * 24.0, "usd": 2.0}
    assert "1.0" in report.cost_table([row]).splitlines()[-1]           # one day on 1,024 GPUs


def test_under_deepspeed_the_script_hands_clipping_to_deepspeed():
    """Lesson 09, section 2: under DeepSpeed the training script does not clip itself; DeepSpeed's
    ``gradient_clipping`` does, the JSON's own value or, where the JSON has none, ``clipping.max_norm``
    (`engine.deepspeed_settings`: ``conf.setdefault("gradient_clipping", cfg.clipping.max_norm)``)."""
    import dataclasses

    from course_lib.training import command, engine

    cfg, layout = command.check(experiments.CONFIGS / "seed004_deepspeed.toml", 2, {"clipping.max_norm": 0.5})
    assert cfg.deepspeed["gradient_clipping"] == 1.0                            # the seed's JSON sets it
    assert engine.deepspeed_settings(cfg, layout)["gradient_clipping"] == 1.0
    bare = dataclasses.replace(cfg, deepspeed={k: v for k, v in cfg.deepspeed.items() if k != "gradient_clipping"})
    assert engine.deepspeed_settings(bare, layout)["gradient_clipping"] == 0.5
    assert 'conf.setdefault("gradient_clipping", cfg.clipping.max_norm)' in inspect.getsource(engine.deepspeed_settings)


# ------------------------------------------------------------------------------ 7. when a large run goes wrong

def test_passes_cut_where_the_step_goes_back():
    recs = _records([0, 1, 2, 3, 2, 3, 4, 4, 5])                       # a rewind to 2, then one to 4
    got = experiments.passes(recs)
    assert [[r["step"] for r in p] for p in got] == [[0, 1, 2, 3], [2, 3, 4], [4, 5]]
    assert experiments.passes([]) == []


SPIKE_EVENT = {"step": 14, "data_position": 14, "metric": "loss", "loss": 7.2, "z_loss": 7.16, "grad_norm": 3.5,
               "z_grad_norm": 3.54, "rewound_to": 12, "batches_skipped": [12, 15], "lr": 2.4e-3}


def test_spike_rows_and_table_read_the_scripts_record():
    unrewound = {k: v for k, v in SPIKE_EVENT.items() if k not in ("rewound_to", "batches_skipped")}
    rows = experiments.spike_rows({"spikes": [SPIKE_EVENT, {**unrewound, "step": 20}]})
    assert rows[0]["redone"] == 2 and rows[0]["skipped"] == (12, 15) and rows[0]["rewound_to"] == 12
    assert rows[1]["redone"] == 0 and rows[1]["skipped"] is None
    table = report.spike_table(rows).splitlines()
    assert "step 12" in table[2] and "12..14" in table[2] and "not rewound" in table[3]
    assert report.spike_table([]) == "no spike detected"
    assert experiments.final_loss({"losses": {"10": 1.0, "2": 9.0, "9": 3.0}}, last=2) == 2.0   # steps by number


def test_stack_dump_takes_the_faulthandler_frames(tmp_path):
    (tmp_path / "rank1.log").write_text(
        "step 6 done\nFatal Python error: Aborted\n\nCurrent thread 0x7f (most recent call first):\n"
        '  File "train.py", line 310 in inject_fault\n  File "train.py", line 432 in train\n\nExtension modules: x\n')
    dump = experiments.stack_dump(tmp_path, 1)
    assert dump[0] == "Fatal Python error: Aborted" and dump[-1].endswith("line 432 in train") and len(dump) == 4
    (tmp_path / "rank0.log").write_text("Traceback: RuntimeError in all_reduce\n")
    assert experiments.stack_dump(tmp_path, 0) == []


def test_loader_resume_restores_the_data_position():
    cfg = ModelConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=16, name="t")
    out = experiments.loader_resume(cfg, global_batch=4, before=3, after=2)
    assert out["same"] and out["fresh_differs"] and out["positions"] == (3, 5)
    assert (out["state"]["epoch"], out["state"]["batch"]) == (0, 3)


def test_token_table_shows_both_averages_against_one_process():
    out = {"valid": [[26, 14], [11, 17]], "reference": {"losses": [4.15]},
           "runs": {"tokens": {"losses": [4.15]}, "mean": {"losses": [4.16]}},
           "loss_err": {"tokens": 1e-7, "mean": 1e-3}, "grad_err": {"tokens": 1e-7, "mean": 0.34}}
    lines = report.token_table(out).splitlines()
    assert "[[26, 14], [11, 17]]" in lines[0] and lines[-1].startswith("mean of the micro-batch means")
    assert "3.4e-01" in lines[-1] and "1.0e-07" in lines[-2]
