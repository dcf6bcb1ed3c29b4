"""The course's training script: a run as a team would operate it (lesson 09).

    torchrun --nproc-per-node 2 -m course_lib.training --config configs/tiny_ddp.toml
    python -m course_lib.training --config configs/tiny_ddp.toml --check --nprocs 2       # validate only
    python -m course_lib.training --config configs/tiny_ddp.toml --nprocs 2               # launches torchrun
    launch("configs/tiny_ddp.toml", nprocs=2)                                             # from a notebook

The command line: ``--config`` names a TOML run config (`course_lib.training.config`), ``--set section.key=VALUE``
overrides a field of it, and `check` validates it for the run's ranks before any rank starts (``--check`` stops
there). Under torchrun each rank joins the process group and runs the loop (`course_lib.training.train`, on the
model and optimizer of `course_lib.training.engine`). With ``--nprocs`` outside torchrun this process launches the
job: `launch` runs this file under torchrun (`launch.run_script`) and watches the ranks' heartbeats
(`course_lib.training.watchdog`): a rank silent for ``watchdog.timeout_s`` is named and stopped, and with
``--max-restarts`` torchrun starts every rank again, the run resuming from its newest checkpoint.

    python -m course_lib.training --config configs/tiny_spike.toml --nprocs 2
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

from course_lib.training.engine import deepspeed_settings
from course_lib.training.train import restart_count, train

__all__ = ["main", "launch", "check"]


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
        store = dist.PrefixStore(f"course-train/attempt-{restart_count()}", store)
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
