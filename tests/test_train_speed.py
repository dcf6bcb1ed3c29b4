"""The training script's speed switches, lesson 12's ladder in a TOML config (course_lib/training: ``[model]
vocab_multiple`` and ``compile``, ``[optimizer] implementation``, ``[precision] dtype`` and ``weights``): refused
before launch where the engine cannot honour them; on 2 gloo ranks each does what it says, read back from the
objects the engine built (`Engine.describe`), and leaves alone the arithmetic it should not change."""

from __future__ import annotations

import math

import pytest

from course_lib.config import ConfigError
from course_lib.training import command
from course_lib.training.config import load_config, parse_config

TINY, FSDP2, DEEPSPEED = "configs/tiny_ddp.toml", "configs/tiny_fsdp2.toml", "configs/seed004_deepspeed.toml"


@pytest.mark.parametrize("raw, field", [
    ({"precision": {"weights": "bfloat16"}}, "precision.weights"),          # engine 'ddp': FSDP2's policy only
    ({"precision": {"weights": "float16"}}, "precision.weights"),
    ({"optimizer": {"implementation": "turbo"}}, "optimizer.implementation"),
    ({"model": {"vocab_multiple": -128}}, "model.vocab_multiple"),
    ({"model": {"vocab_multiple": 1.5}}, "model.vocab_multiple"),
    ({"model": {"compile": "yes"}}, "model.compile"),
])
def test_bad_speed_switches_name_their_field(raw, field):
    with pytest.raises(ConfigError) as err:
        parse_config(raw, "test.toml")
    assert field in str(err.value) and "test.toml" in str(err.value)


@pytest.mark.parametrize("override, field, fix", [
    ({"model.compile": True}, "model.compile", "model.compile = false"),
    ({"precision.dtype": "bfloat16"}, "precision.dtype", "bf16.enabled in the [deepspeed] JSON"),
    ({"precision.weights": "bfloat16"}, "precision.weights", "enable bf16 in the [deepspeed] JSON"),
])
def test_deepspeed_refuses_the_switches_it_does_not_take(override, field, fix):
    with pytest.raises(ConfigError) as err:
        load_config(DEEPSPEED, override)
    assert field in str(err.value) and fix in str(err.value)


def test_defaults_change_nothing():
    cfg = load_config(TINY)
    assert (cfg.model.vocab_multiple, cfg.model.compile, cfg.optimizer.implementation, cfg.precision.dtype,
            cfg.precision.weights) == (0, False, "default", "float32", "float32")


def _run(tmp_path, name: str, config: str = TINY, **overrides) -> dict:
    sets = {"job.name": name, "job.out_dir": str(tmp_path / name), "schedule.steps": 4, "schedule.warmup_steps": 2,
            "checkpoint.interval": 0,
            "logging.alerts": False, **overrides}
    return command.launch(config, 2, sets, stream=False, timeout_s=300)[1]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("plain"), "plain")


def _losses(record: dict) -> list[float]:
    return [record["losses"][str(s)] for s in range(4)]


def test_plain_run_is_what_the_defaults_build(plain):
    assert plain["built"] == {"vocab_rows": 256, "optimizer": "default", "compiled": False, "autocast": False,
                              "forward_weight_dtype": "float32"}
    assert all(math.isfinite(v) for v in _losses(plain))


@pytest.mark.slow            # inductor compiles the step on both ranks: about a minute on 2 cores
def test_compile_and_fused_adamw_keep_the_arithmetic(tmp_path, plain):
    fast = _run(tmp_path, "fast", **{"model.compile": True, "optimizer.implementation": "fused"})
    assert fast["built"]["compiled"] and fast["built"]["optimizer"] == "fused"
    # The same fp32 update in other kernels: inductor reorders and fuses reductions, so not bit-equal; four steps
    # stay within 1e-4 (a wrong update, e.g. a lost weight decay or a skipped micro-batch, moves them by 1e-3 or more).
    assert _losses(fast) == pytest.approx(_losses(plain), rel=1e-4, abs=0)


def test_bf16_autocast_is_applied_under_ddp(tmp_path, plain):
    bf = _run(tmp_path, "autocast", **{"precision.dtype": "bfloat16"})
    assert bf["built"]["autocast"] and bf["built"]["forward_weight_dtype"] == "float32"   # weights stay fp32
    diffs = [abs(a / b - 1) for a, b in zip(_losses(bf), _losses(plain))]
    assert max(diffs) > 1e-6, "bf16 autocast left every loss bit-equal to fp32: it was not applied"
    assert max(diffs) < 0.02, f"bf16 autocast moved the losses by {max(diffs):.2%}: more than rounding"


def test_fsdp2_bf16_weights_with_a_padded_vocabulary(tmp_path, plain):
    run = _run(tmp_path, "bf16w", FSDP2, **{"precision.weights": "bfloat16", "precision.dtype": "bfloat16",
                                            "model.vocab_multiple": 384})
    assert run["built"]["vocab_rows"] == 384 and run["built"]["forward_weight_dtype"] == "bfloat16"
    losses = _losses(run)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    # The 128 extra logits are 0 (zero rows) and enter the softmax's normaliser. At init every logit is small (weights
    # of std 0.02), so the sum of exp over the 256 real logits is about 256 and the first loss rises by about
    # ln(1 + 128/256) = ln 1.5 = 0.405 over the unpadded run's (measured: 0.398, bf16 included); without the padding
    # it would not move beyond bf16's rounding.
    assert losses[0] - _losses(plain)[0] == pytest.approx(math.log(1.5), abs=0.03)
