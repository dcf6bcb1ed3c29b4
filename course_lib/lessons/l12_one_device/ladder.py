"""The ladder of lesson 12: one device at full speed, one change at a time, every rung measured in the same run.

Each rung (`Rung`) is a training step of the course's GPT (forward, backward, AdamW step) that adds one thing to the
rung before it (`RUNGS`, in order): fp32 eager -> bf16 autocast -> bf16 weights with fp32 masters -> padded
vocabulary -> fused attention -> foreach/fused AdamW -> torch.compile -> larger micro-batch -> fp8 (the course's
Float8Linear, `parallel.float8`, compiled with the rest; measured only on GPUs with FP8 tensor cores) -> CUDA graphs. Hugging
Face's GPT2LMHeadModel at the same shape and weights runs beside them (`baseline_options`). All steps are built first,
then timed in alternating rounds (the median of every timed step), so that a noisy machine slows them alike and the
ratios between rungs are fair.

    rows = ladder(cfg, batch_size=8)              # one dict per rung, then the transformers rows

MFU follows PaLM (Chowdhery et al. 2022, appendix B): model FLOPs of the *unpadded* model (`theory.flops.step_flops`:
6N + attention, no recomputation) per second over one peak for every rung (`device_peak`: a GPU's datasheet bf16
dense number, `measure.speed.peak_flops`; on a CPU the best matmul measured here in fp32 or bf16), and over the best
matmul measured here in the rung's own compute dtype (`mfu_matmul`). Padding the vocabulary adds executed work, not
model work: it shows in ``hfu`` (executed FLOPs, the padded shape) and never raises MFU by itself.

A new rung is a `Rung` whose ``change`` returns the options of the rung below with one switch changed (a model
transform goes in ``StepOptions.transforms``, as the fp8 rung's does) and whose ``available`` says where it runs;
`insert_rung(RUNGS, rung, after=...)` puts it in the ladder.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from course_lib.config import ModelConfig, get_preset
from course_lib.data import random_batches
from course_lib.lessons.l12_one_device import fp8
from course_lib.lessons.l12_one_device.profile import profile_step
from course_lib.lessons.l12_one_device.steps import StepOptions, build_step, compute_dtype
from course_lib.lessons.sizes import by_device
from course_lib.measure import hardware, speed
from course_lib.parallel.fast_step import compile_support, fused_optimizer_support
from course_lib.theory.flops import step_flops

__all__ = ["Rung", "LadderSetup", "RUNGS", "insert_rung", "bf16_support", "fused_optimizer_support", "compile_support",
           "cuda_graphs_support", "baseline_options", "TWIN", "device_peak", "ladder", "default_sizes", "CPU_CONFIG"]


@dataclass(frozen=True)
class LadderSetup:
    """What a rung's change may read: the device, the ladder's batch and the largest micro-batch to try."""

    device: torch.device
    batch_size: int
    max_micro_batch: int


def _always(device: torch.device) -> tuple[bool, str]:
    return True, ""


@dataclass(frozen=True)
class Rung:
    """One rung: ``change(options, setup)`` returns the step options of this rung from those of the rung below;
    ``available(device)`` -> (runs here, note): a rung that does not run is reported as skipped with the note as
    its reason; one that runs carries the note (e.g. bf16 on a CPU without bf16 instructions)."""

    name: str
    change: Callable[[StepOptions, LadderSetup], StepOptions]
    adds: str
    available: Callable[[torch.device], tuple[bool, str]] = _always


def bf16_support(device: torch.device) -> tuple[bool, str]:
    """Always runs; the note says whether bf16 is native here (CPU: AVX512-BF16 or AMX, `hardware.cpu_features`;
    GPU: ``torch.cuda.is_bf16_supported``). Without it the rung is measured but flagged: 16-bit operands are
    converted to fp32 and back, so expect it slower."""
    if device.type == "cuda":
        fast = torch.cuda.is_bf16_supported(including_emulation=False)
        return True, "native bf16" if fast else "FLAGGED: no native bf16 on this GPU (emulated, expect slower)"
    f = hardware.cpu_features()
    if f["bf16"]:
        return True, f"native bf16 ({f['isa']}{', ' + ', '.join(f['amx']) if f['amx'] else ''})"
    return True, f"FLAGGED: no AVX512-BF16/AMX on this CPU ({f['isa']}): bf16 converted to fp32 and back, expect slower"


def cuda_graphs_support(device: torch.device) -> tuple[bool, str]:
    """CUDA graphs replay recorded GPU work: a GPU only."""
    if device.type != "cuda":
        return False, "CUDA graphs need a CUDA device: this ladder runs on the CPU"
    return True, "torch.compile(mode='reduce-overhead'): forward and backward replayed as CUDA graphs"


def _optimizer(opts: StepOptions, setup: LadderSetup) -> StepOptions:
    return dataclasses.replace(opts, optimizer="fused" if fused_optimizer_support(setup.device)[0] else "foreach")


RUNGS: tuple[Rung, ...] = (
    Rung("fp32 eager", lambda o, s: o, "fp32, naive attention, for-loop AdamW (foreach=False)"),
    Rung("bf16 autocast", lambda o, s: dataclasses.replace(o, autocast=True),
         "matmuls in bf16 under torch.autocast, weights fp32", bf16_support),
    Rung("bf16 weights + fp32 master", lambda o, s: dataclasses.replace(o, bf16_weights=True),
         "bf16 parameters, AdamW on fp32 masters (MasterWeightOptimizer)"),
    Rung("padded vocab", lambda o, s: dataclasses.replace(o, vocab_multiple=128),
         "vocabulary rounded up to a multiple of 128"),
    Rung("fused attention (SDPA)", lambda o, s: dataclasses.replace(o, attention="sdpa"),
         "F.scaled_dot_product_attention instead of the written-out softmax"),
    Rung("foreach/fused AdamW", _optimizer, "AdamW over all tensors at once",
         lambda device: (True, fused_optimizer_support(device)[1])),            # falls back to foreach: always runs
    Rung("torch.compile", lambda o, s: dataclasses.replace(o, compile="default"),
         "forward + loss compiled by inductor (compile time reported apart)", compile_support),
    Rung("larger micro-batch", lambda o, s: dataclasses.replace(o, micro_batch=s.max_micro_batch),
         "micro-batch doubled up to the memory limit or max_micro_batch"),
    Rung("fp8", lambda o, s: dataclasses.replace(o, transforms=(*o.transforms, fp8.float8_linears)),
         "every linear but the LM head in FP8, tensorwise scales (course_lib.parallel.float8)",
         fp8.fp8_gemm_available),
    Rung("CUDA graphs", lambda o, s: dataclasses.replace(o, compile="reduce-overhead"),
         "kernel launches replayed from a recorded graph", cuda_graphs_support),
)


def insert_rung(rungs: Sequence[Rung], rung: Rung, after: str) -> tuple[Rung, ...]:
    """``rungs`` with ``rung`` placed after the rung named ``after`` (e.g. a rung of one's own)."""
    names = [r.name for r in rungs]
    if after not in names:
        raise ValueError(f"after={after!r} names no rung: pick one of {names}")
    i = names.index(after) + 1
    return (*rungs[:i], rung, *rungs[i:])


TWIN = "course GPT, the baseline's options"     # the course's model with exactly the first transformers row's switches


def baseline_options(opts: StepOptions, device: torch.device, compile_baseline: bool) -> list[tuple[str, StepOptions]]:
    """The transformers rows: GPT2LMHeadModel with SDPA attention, fp32 weights under the same autocast as the
    ladder (Hugging Face Trainer's ``bf16=True`` recipe), fused AdamW where supported, the ladder's micro-batch;
    and the same compiled (``compile_baseline``)."""
    fused = fused_optimizer_support(device)[0]
    base = StepOptions(autocast=opts.autocast or opts.bf16_weights, attention="sdpa",
                       optimizer="fused" if fused else "foreach", micro_batch=opts.micro_batch, library="transformers")
    out = [("transformers (SDPA, fused AdamW)" if fused else "transformers (SDPA, foreach AdamW)", base)]
    if compile_baseline and compile_support(device)[0]:
        out.append(("transformers + torch.compile", dataclasses.replace(base, compile="default")))
    return out


def device_peak(device: torch.device) -> tuple[float, str]:
    """(FLOP/s, where from): the one peak every rung's MFU divides by. A GPU: `speed.peak_flops` (its datasheet's
    dense bf16 number, whatever precision a rung runs in, as PaLM's MFU does). A CPU has no datasheet number worth
    quoting: the best matmul measured here in fp32 or bf16 (`speed.measure_peak_matmul_flops`), the faster of the two
    (bf16 where the CPU has bf16 instructions), so that no rung reads above its device's peak."""
    if device.type == "cuda":
        return speed.peak_flops(device)
    flops, dtype = max((speed.measure_peak_matmul_flops(device, dt), dt) for dt in (torch.float32, torch.bfloat16))
    return flops, f"measured: best {str(dtype).replace('torch.', '')} matmul here"


@dataclass
class _Entry:
    name: str
    library: str
    note: str
    built: object = None
    peak_bytes: int | None = None
    times: list = dataclasses.field(default_factory=list)


def _build(cfg, opts, setup, x, y, seed, warmup) -> tuple[object, int | None, str]:
    """(built step, peak bytes on a GPU, why not): the micro-batch halves on out-of-memory; a failed
    torch.compile is a reason to skip, any other error a bug."""
    device, cuda = setup.device, setup.device.type == "cuda"
    while True:
        batch = opts.micro_batch or setup.batch_size
        try:
            if cuda:
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            built = build_step(cfg, opts, x[:batch], y[:batch], device, seed)
            for _ in range(warmup - 1):
                built.step()
            peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
            return built, peak, ""
        except torch.OutOfMemoryError:
            pass                                   # free the failed try's tensors below, once its traceback is gone
        except Exception as e:  # noqa: BLE001 - only compilation failures are expected here
            if not opts.compile:
                raise
            first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            return None, None, f"torch.compile failed: {type(e).__name__}: {first[:160]}"
        if cuda:
            torch.cuda.empty_cache()
        if opts.micro_batch is None or opts.micro_batch // 2 <= setup.batch_size:
            return None, None, f"out of memory at micro-batch {batch}"
        opts = dataclasses.replace(opts, micro_batch=opts.micro_batch // 2)


def ladder(cfg: ModelConfig, batch_size: int, device=None, rungs: Sequence[Rung] | None = None, steps: int = 2,
           warmup: int = 2, rounds: int = 3, max_micro_batch: int | None = None, baseline: bool = True,
           compile_baseline: bool | None = None, profile: bool = True, seed: int = 0) -> list[dict]:
    """Build every rung of ``rungs`` (default `RUNGS`) on ``device``, each from the same weights and batch
    (``batch_size`` sequences of ``cfg.seq_len``; the larger micro-batch rung goes up to ``max_micro_batch``,
    default 4 x batch on a GPU, 2 x on a CPU), with ``warmup`` untimed steps each (the first one compiles); then
    ``rounds`` rounds of ``steps`` timed steps per rung in turn. ``baseline``: the transformers rows
    (`baseline_options`; ``compile_baseline`` default: on a GPU only, inductor's CPU compile takes tens of seconds).
    After the first transformers row comes the course's GPT built with exactly its switches (`TWIN`): the
    like-for-like comparison of the two models. ``profile``: two profiled steps per rung (time by kind, top kernels, kernel count; CPU peak memory).

    Returns one row per rung (then per baseline) with: rung, library, status ('measured' or 'skipped'), note
    (the reason when skipped), batch, tokens, step_s, tokens_per_s, model_flops (unpadded, per step),
    executed_flops (padded shape), mfu, hfu, mfu_matmul, peak, peak_source, matmul_peak, matmul_dtype, peak_bytes,
    state_bytes, memory_source, loss0, first_step_s, compile_s, kernels, breakdown, hardware.
    """
    device = torch.device(device) if device is not None else hardware.default_device()
    cuda = device.type == "cuda"
    rungs = RUNGS if rungs is None else tuple(rungs)
    setup = LadderSetup(device, batch_size, max(batch_size, max_micro_batch or batch_size * (4 if cuda else 2)))
    (x, y), = random_batches(cfg, setup.max_micro_batch, 1, seed)          # every rung reads the first B rows
    entries, opts = [], StepOptions()
    for rung in rungs:
        runs, note = rung.available(device)
        built, peak = None, None
        if runs:
            built, peak, why = _build(cfg, rung.change(opts, setup), setup, x, y, seed, warmup)
            note = why or note
        if built is not None:
            opts = built.opts                                    # a skipped rung's change is not carried up
        entries.append(_Entry(rung.name, "course", note, built, peak))
    if baseline:
        compile_baseline = cuda if compile_baseline is None else compile_baseline
        for i, (name, o) in enumerate(baseline_options(opts, device, compile_baseline)):
            built, peak, why = _build(cfg, o, setup, x, y, seed, warmup)
            entries.append(_Entry(name, "transformers", why, built, peak))
            if i == 0:                                           # like for like: the course's GPT, the same switches
                twin = dataclasses.replace(o, library="course")
                built, peak, why = _build(cfg, twin, setup, x, y, seed, warmup)
                entries.append(_Entry(TWIN, "course", why, built, peak))
    live = [e for e in entries if e.built is not None]
    for _ in range(rounds):                                      # interleaved: a slow spell hits every rung
        for e in live:
            e.times += speed.time_fn(e.built.step, warmup=0, repeats=steps, device=device, return_all=True)
    label, (peak, source) = hardware.hardware_label(device=device), device_peak(device)
    return [_row(e, cfg, device, label, peak, source, profile) for e in entries]


def _row(e: _Entry, cfg: ModelConfig, device: torch.device, label: str, peak: float, peak_source: str,
         profile: bool) -> dict:
    row = dict(rung=e.name, library=e.library, status="skipped" if e.built is None else "measured", note=e.note,
               hardware=label, device=str(device))
    if e.built is None:
        return row
    b = e.built
    step_s = statistics.median(e.times)
    dtype = compute_dtype(b.opts)
    matmul_peak = speed.measure_peak_matmul_flops(device, dtype)
    model_flops = step_flops(cfg, b.batch)                      # unpadded: padding is executed work, not model work
    executed = step_flops(b.cfg, b.batch)
    prof = profile_step(b.step, device, steps=2) if profile else None
    state = b.state_bytes()
    if e.peak_bytes is not None:
        peak_bytes, source = e.peak_bytes, "torch.cuda.max_memory_allocated over build + warm-up"
    elif prof is not None and prof["peak_bytes"] is not None:
        peak_bytes, source = state + prof["peak_bytes"], "state counted from tensors + the profiler's peak over two steps"
    else:
        peak_bytes, source = None, "not measured (profile=False)"
    row.update(batch=b.batch, tokens=b.batch * cfg.seq_len, step_s=step_s,
               tokens_per_s=speed.tokens_per_s(b.batch * cfg.seq_len, step_s), model_flops=model_flops,
               executed_flops=executed, mfu=speed.mfu(model_flops / step_s, peak), hfu=executed / step_s / peak,
               mfu_matmul=speed.mfu(model_flops / step_s, matmul_peak), peak=peak, peak_source=peak_source,
               matmul_peak=matmul_peak, matmul_dtype=str(dtype).replace("torch.", ""), peak_bytes=peak_bytes,
               state_bytes=state, memory_source=source, loss0=b.loss0, first_step_s=b.first_step_s,
               compile_s=max(0.0, b.first_step_s - step_s) if b.opts.compile else 0.0,
               kernels=prof["kernels"] if prof else None, breakdown=prof, vocab_size=b.cfg.vocab_size,
               options=dataclasses.asdict(b.opts))
    return row


# A CPU size at which the whole ladder runs in about a minute on 2 cores: the LM head dominates (as in GPT-2 small,
# where it is a third of the matmul weights), with a vocabulary one short of a multiple of 128. Not 8191: at batch 8 x
# 128 its padded fp32 logits take exactly 32 MiB, where glibc's malloc starts serving each allocation with fresh pages
# from mmap (its largest dynamic mmap threshold), so the padded rung would measure page faults, not the matmuls.
CPU_CONFIG = ModelConfig(vocab_size=6143, seq_len=128, n_layer=2, n_head=4, d_model=128, name="ladder-cpu")
QUICK_CONFIG = CPU_CONFIG.replace(seq_len=64, n_layer=1, name="ladder-quick")


def default_sizes() -> tuple[ModelConfig, int]:
    """(config, batch) for this machine (`lessons.sizes.by_device`): GPT-2 124M at batch 8 x 1024 on a GPU,
    `CPU_CONFIG` at batch 8 on a CPU, smaller still for quick runs."""
    return by_device(cpu=(CPU_CONFIG, 8), gpu=(get_preset("gpt2-124m"), 8), quick=(QUICK_CONFIG, 4))
