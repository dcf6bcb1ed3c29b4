"""The course's training script and its parts (lesson 09): a run as a team would operate it.

    torchrun --nproc-per-node 2 -m course_lib.training --config configs/tiny_ddp.toml
    python -m course_lib.training --config configs/tiny_ddp.toml --check --nprocs 2      # validate only

    train.py        the loop: a run resumed from its newest checkpoint, metrics, alerts, faults injected
    engine.py       the model, optimizer and schedule behind one step (DDP, FSDP2 or DeepSpeed)
    command.py      the command line: --check, --set, and the launch under torchrun with restarts
    config.py       the TOML config, validated field by field before anything starts
    monitor.py      metrics to TensorBoard and JSON lines, read back, plotted live
    alerts.py       alert rules with durations (loss spike, NaN, throughput drop, straggler)
    spikes.py       loss-spike detection by a z-score over a window; recovery.py rewinds and skips (PaLM)
    watchdog.py     heartbeats per rank; the hung rank named
    token_loss.py   a loss divided by the global number of valid tokens

May import: the core, `course_lib.runtime`, `course_lib.measure`, `course_lib.theory`, `course_lib.parallel` and
itself; never the lessons, grading or the instructor's tools (tests/test_layout.py).
"""
