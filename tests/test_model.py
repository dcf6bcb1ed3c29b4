"""Tests for course_lib.model: shapes, init, parameter counts, and equality with transformers' GPT-2."""

import math

import pytest
import torch

from course_lib.config import ConfigError, get_preset
from course_lib.data import synthetic_corpus, get_batch
from course_lib.model import GPT, build_model, hf_gpt2_config, to_hf_gpt2


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return get_preset("tiny")


def hf_numel(cfg):
    from transformers import GPT2LMHeadModel
    with torch.device("meta"):   # shapes only: no memory, no init time
        return sum(p.numel() for p in GPT2LMHeadModel(hf_gpt2_config(cfg)).parameters())


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_param_count_own_equals_config_equals_hf(name):
    cfg = get_preset(name)
    model = build_model(cfg)
    assert model.num_params() == sum(p.numel() for p in model.parameters()) == cfg.num_params() == hf_numel(cfg)


def test_param_count_variants_and_gpt2_124m(tiny):
    for cfg in (tiny.replace(tie_embeddings=False), tiny.replace(bias=False), tiny.replace(d_ff=100)):
        assert build_model(cfg).num_params() == cfg.num_params()
    cfg = get_preset("gpt2-124m")
    with torch.device("meta"):
        assert GPT(cfg).num_params() == cfg.num_params() == 124_439_808
    assert hf_numel(cfg) == 124_439_808


def test_attribute_names_and_tied_head(tiny):
    m = build_model(tiny)
    assert isinstance(m.blocks, torch.nn.ModuleList) and len(m.blocks) == 2
    b = m.blocks[0]
    assert (b.attn.qkv.in_features, b.attn.qkv.out_features) == (64, 192)
    assert (b.attn.proj.in_features, b.attn.proj.out_features) == (64, 64)
    assert (b.mlp.fc.out_features, b.mlp.proj.in_features) == (256, 256)
    assert isinstance(b.ln1, torch.nn.LayerNorm) and isinstance(b.ln2, torch.nn.LayerNorm)
    assert isinstance(m.ln_f, torch.nn.LayerNorm)
    assert m.head.weight is m.tok_emb.weight
    assert tuple(m.pos_emb.weight.shape) == (64, 64)
    assert build_model(tiny.replace(tie_embeddings=False)).head.weight is not None
    assert build_model(tiny.replace(tie_embeddings=False)).head.weight is not \
        build_model(tiny.replace(tie_embeddings=False)).tok_emb.weight


def test_gpt2_init_and_seeding():
    cfg = get_preset("small")
    m = build_model(cfg, seed=1)
    assert torch.equal(m.blocks[0].attn.qkv.weight, build_model(cfg, seed=1).blocks[0].attn.qkv.weight)
    assert not torch.equal(m.blocks[0].attn.qkv.weight, build_model(cfg, seed=2).blocks[0].attn.qkv.weight)
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert m.blocks[0].attn.proj.weight.std().item() == pytest.approx(resid, rel=0.05)
    assert m.blocks[1].mlp.proj.weight.std().item() == pytest.approx(resid, rel=0.05)
    assert m.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert m.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(m.blocks[0].attn.qkv.bias == 0) and torch.all(m.ln_f.weight == 1)


def test_shapes_causality_and_errors(tiny):
    m = build_model(tiny).eval()
    idx = torch.randint(0, 256, (2, 10))
    logits = m(idx)
    assert logits.shape == (2, 10, 256)
    idx2 = idx.clone()
    idx2[:, 7] = (idx2[:, 7] + 1) % 256        # change a later token: earlier logits are unchanged
    logits2 = m(idx2)
    assert torch.allclose(logits[:, :7], logits2[:, :7], atol=1e-6)
    assert not torch.allclose(logits[:, 7:], logits2[:, 7:])
    with pytest.raises(ValueError, match="T=65 exceeds cfg.seq_len=64"):
        m(torch.zeros(1, 65, dtype=torch.long))
    for name in ("llama-7b", "llama-70b"):
        with pytest.raises(ConfigError, match="theory-only"):
            GPT(get_preset(name))
    with pytest.raises(ConfigError, match="n_kv_head=2"):
        GPT(tiny.replace(n_kv_head=2))


@pytest.mark.parametrize("tie", [True, False])
def test_same_logits_and_loss_as_transformers_gpt2(tiny, tie):
    cfg = tiny.replace(tie_embeddings=tie)
    model = build_model(cfg, seed=3).eval()
    hf = to_hf_gpt2(model)
    assert not hf.training
    assert hf.config.activation_function == "gelu_new" and hf.config.n_positions == 64
    idx = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(idx)
        out = hf(idx, labels=idx)          # HF shifts the labels inside
    torch.testing.assert_close(ours, out.logits, atol=1e-5, rtol=0)
    loss = model.loss(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(loss, out.loss, atol=1e-5, rtol=0)


def test_training_steps_take_loss_down(tiny):
    tokens, _ = synthetic_corpus(20_000, vocab_size=256, seed=0)
    model = build_model(tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = get_batch(tokens, 4, 32, step=0)
    losses = []
    for step in range(8):                   # fit one batch: the loss must fall well below the uniform guess
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)   # uniform guess at init
    assert losses[-1] < losses[0] - 1.0, losses


# ---- lesson 09: QK-norm, the largest attention logit, z-loss (options off: the model above, bit for bit) ----

def test_options_off_leave_the_model_bit_identical(tiny):
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    plain = build_model(tiny, seed=5)
    ref = plain(idx)
    from course_lib.model import max_attention_logit, track_attention_logits
    assert math.isnan(max_attention_logit(plain))                        # nothing recorded unless asked
    track_attention_logits(plain)
    assert torch.equal(plain(idx), ref)                                  # recording changes no output
    track_attention_logits(plain, on=False)
    assert torch.equal(plain(idx), ref) and math.isnan(max_attention_logit(plain))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in build_model(tiny).named_parameters()]
    assert not any("q_norm" in n for n in plain.state_dict())


def test_max_attention_logit_is_the_largest_causal_q_dot_k(tiny):
    from course_lib.model import max_attention_logit, track_attention_logits
    for qk in (False, True):
        cfg = tiny.replace(qk_norm=qk)
        model = build_model(cfg, seed=2)
        with torch.no_grad():                                    # make the logits large, and one future key huge
            model.blocks[1].attn.qkv.weight.mul_(20)
        track_attention_logits(model)
        idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
        model(idx)
        by_hand, unmasked, captured = [], [], {}
        for block in model.blocks:
            block.attn.register_forward_pre_hook(lambda m, a: captured.__setitem__(m, a[0]))
        model(idx)
        for block in model.blocks:
            a, x = block.attn, captured[block.attn]
            B, T, C = x.shape
            q, k, _ = a.qkv(x).split(C, dim=-1)
            q, k = (t.view(B, T, a.n_head, a.head_dim).transpose(1, 2) for t in (q, k))
            if qk:
                q, k = a.q_norm(q), a.k_norm(k)
            s = (q @ k.transpose(-2, -1)) / math.sqrt(a.head_dim)          # (B, H, T, T)
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            by_hand.append(s[..., causal].max().item())
            unmasked.append(s.max().item())
        assert max_attention_logit(model) == pytest.approx(max(by_hand), rel=1e-5)
        assert max(unmasked) > max(by_hand) * 1.01, "no future key is larger: the mask would go untested"


def test_qk_norm_counts_its_parameters_and_bounds_the_logits(tiny):
    cfg = tiny.replace(qk_norm=True)
    model = build_model(cfg)
    assert model.num_params() == cfg.num_params() == tiny.num_params() + tiny.n_layer * 2 * 2 * tiny.head_dim
    assert build_model(cfg.replace(bias=False)).num_params() == cfg.replace(bias=False).num_params()
    assert isinstance(model.blocks[0].attn.q_norm, torch.nn.LayerNorm)
    with pytest.raises(ConfigError, match="qk_norm"):
        hf_gpt2_config(cfg)
    with pytest.raises(ConfigError, match="qk_norm"):
        tiny.replace(qk_norm=1)
    # LayerNorm'd q, k have norm sqrt(D) (weights 1, bias 0): |q.k| / sqrt(D) <= sqrt(D) whatever the weights
    from course_lib.model import max_attention_logit, track_attention_logits
    with torch.no_grad():
        for b in model.blocks:
            b.attn.qkv.weight.mul_(50)
    track_attention_logits(model)
    model(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)))
    plain = build_model(tiny)
    with torch.no_grad():
        for b in plain.blocks:
            b.attn.qkv.weight.mul_(50)
    track_attention_logits(plain)
    plain(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)))
    assert max_attention_logit(model) <= math.sqrt(tiny.head_dim) * (1 + 1e-4) < max_attention_logit(plain) / 10


def test_z_loss_is_palms_log_z_squared():
    from course_lib.model import z_loss
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g) * 3
    per = torch.log(torch.exp(logits.double()).sum(-1)) ** 2                     # (B, T): log^2 Z by hand
    torch.testing.assert_close(z_loss(logits).double(), per.mean(), rtol=1e-6, atol=0)
    y = torch.tensor([[1, -100, 2], [-100, -100, 0]])
    torch.testing.assert_close(z_loss(logits, y).double(), per[y != -100].mean(), rtol=1e-6, atol=0)
    torch.testing.assert_close(z_loss(logits, y, reduction="sum").double(), per[y != -100].sum(), rtol=1e-6, atol=0)
    assert z_loss(logits - torch.logsumexp(logits, -1, keepdim=True)).item() < 1e-10   # normalised: log Z = 0
    with pytest.raises(ValueError, match="reduction"):
        z_loss(logits, reduction="none")
