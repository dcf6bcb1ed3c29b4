"""Tests for course_lib.config: validation messages, presets and exact parameter counts."""

import dataclasses
import pickle

import pytest

from course_lib.config import PRESETS, ConfigError, ModelConfig, TrainConfig, get_preset

TINY = dict(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64)


@pytest.mark.parametrize("changes, words", [
    (dict(n_head=3), ["n_head=3", "d_model=64", "pick n_head in {1, 2, 4, 8"]),
    (dict(n_head=8, n_kv_head=3), ["n_kv_head=3", "n_head=8", "pick n_kv_head in {1, 2, 4, 8}"]),
    (dict(d_model=0), ["d_model=0", "positive int"]),
    (dict(n_layer=2.0), ["n_layer=2.0", "positive int"]),
    (dict(vocab_size=-1), ["vocab_size=-1", "positive int"]),
    (dict(d_ff=0), ["d_ff=0", "positive int"]),
    (dict(dropout=1.0), ["dropout=1.0", "[0, 1)"]),
    (dict(dropout=-0.1), ["dropout=-0.1", "[0, 1)"]),
    (dict(norm="batchnorm"), ["norm='batchnorm'", "'layernorm', 'rmsnorm'"]),
    (dict(mlp="relu"), ["mlp='relu'", "'gelu', 'swiglu'"]),
    (dict(pos="alibi"), ["pos='alibi'", "'learned', 'rope'"]),
    (dict(bias=1), ["bias=1", "True or False"]),
])
def test_model_config_errors_name_field_and_fix(changes, words):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**TINY, **changes})
    for w in words:
        assert w in str(err.value)
    assert isinstance(err.value, ValueError)


def test_defaults_resolved_and_frozen():
    cfg = ModelConfig(**TINY)
    assert cfg.d_ff == 256 and cfg.n_kv_head == 4 and cfg.head_dim == 16
    assert cfg == ModelConfig(**TINY, d_ff=256, n_kv_head=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 128
    # replace() derives defaulted fields again; an explicit d_ff is kept
    assert cfg.replace(d_model=128).d_ff == 512
    assert cfg.replace(d_ff=100).replace(d_model=128).d_ff == 100
    assert pickle.loads(pickle.dumps(cfg)).replace(n_head=8).n_kv_head == 8
    assert ModelConfig(**dataclasses.asdict(cfg)) == cfg


@pytest.mark.parametrize("kwargs, words", [
    (dict(batch_size=8, micro_batch_size=3), ["micro_batch_size=3", "batch_size=8", "{1, 2, 4, 8}"]),
    (dict(batch_size=0), ["batch_size=0", "positive int"]),
    (dict(lr=0.0), ["lr=0.0", "positive"]),
    (dict(weight_decay=-1.0), ["weight_decay=-1.0", ">= 0"]),
    (dict(betas=(0.9, 1.0)), ["betas=", "[0, 1)"]),
    (dict(warmup_steps=200, max_steps=100), ["warmup_steps=200", "max_steps=100"]),
    (dict(grad_clip=-1.0), ["grad_clip=-1.0"]),
    (dict(seed=-1), ["seed=-1"]),
    (dict(dtype="fp8"), ["dtype='fp8'", "'float32', 'bfloat16', 'float16'"]),
])
def test_train_config_errors_name_field_and_fix(kwargs, words):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_train_config_grad_accum():
    import torch
    tc = TrainConfig(batch_size=16, micro_batch_size=2, dtype="bfloat16")
    assert tc.grad_accum == 8 and tc.grad_accum_steps(world_size=4) == 2
    assert tc.torch_dtype is torch.bfloat16
    assert TrainConfig(batch_size=8).grad_accum == 1
    with pytest.raises(ConfigError, match="micro_batch_size\\*world_size"):
        tc.grad_accum_steps(world_size=3)


def test_unknown_preset_lists_names():
    with pytest.raises(ConfigError) as err:
        get_preset("gpt5")
    for name in PRESETS:
        assert name in str(err.value)


def test_preset_shapes():
    assert get_preset("tiny") == ModelConfig(**TINY, name="tiny")
    small = get_preset("small")
    assert (small.vocab_size, small.seq_len, small.n_layer, small.n_head, small.d_model) == (256, 128, 4, 4, 128)
    for name in PRESETS:
        assert get_preset(name).name == name
    assert get_preset("llama-7b").gpt2_style is False and get_preset("gpt2-1.5b").gpt2_style is True


def test_known_param_counts():
    assert get_preset("gpt2-124m").num_params() == 124_439_808
    # Kaplan et al. 2020 "non-embedding" count: 85M for GPT-2 small
    assert get_preset("gpt2-124m").num_params(include_embeddings=False) == 124_439_808 - 50257 * 768 - 1024 * 768
    assert get_preset("gpt2-350m").num_params() == 354_823_168
    assert get_preset("gpt2-774m").num_params() == 774_030_080
    assert get_preset("gpt2-1.5b").num_params() == 1_557_611_200
    assert get_preset("llama-7b").num_params() == 6_738_415_616          # Meta's "6.7B"
    assert get_preset("llama-70b").num_params() == 68_976_648_192        # Meta's "69B" ("70B")
    assert abs(get_preset("gpt3-175b").num_params() / 175e9 - 1) < 0.01   # Brown et al. 2020
    # llama: untied head is kept in the non-embedding count, the token table is not
    l7 = get_preset("llama-7b")
    assert l7.num_params() - l7.num_params(include_embeddings=False) == 32000 * 4096
