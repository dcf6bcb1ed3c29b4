"""Tests for course_lib.data: tokenizer, offline corpora, synthetic ideal loss, sharded batches."""

import pytest
import torch

from course_lib.data import (ByteTokenizer, get_batch, markov_transition_matrix, synthetic_corpus,
                             text_corpus)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "data parallelism 数据并行, naïve — ok\n"
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert tok.decode(ids) == text
    t = tok.encode_tensor(text)
    assert t.dtype == torch.long and t.tolist() == ids
    assert tok.decode(t) == text
    assert tok.decode([0xE6]) == "\ufffd"        # a cut multi-byte character does not crash
    with pytest.raises(ValueError, match="0..255"):
        tok.decode([256])


def test_text_corpus_is_real_deterministic_python_source():
    a = text_corpus(max_bytes=50_000)
    assert a.dtype == torch.uint8 and a.shape == (50_000,)
    assert torch.equal(a, text_corpus(max_bytes=50_000))
    head = ByteTokenizer().decode(a[:2000])
    assert head.startswith("# file: ") and ("def " in head or "import " in head)
    small = text_corpus(max_bytes=1000)
    assert torch.equal(small, a[:1000])           # a prefix of the same stream
    with pytest.raises(ValueError, match="max_bytes"):
        text_corpus(max_bytes=0)


def test_synthetic_markov_ideal_loss_matches_empirical():
    tokens, ideal = synthetic_corpus(100_000, vocab_size=64, seed=1)
    assert tokens.dtype == torch.long and tokens.shape == (100_000,)
    assert 0 <= tokens.min() and tokens.max() < 64
    P = markov_transition_matrix(64, seed=1)
    assert torch.allclose(P.sum(1), torch.ones(64, dtype=torch.float64))
    # mean -log p(next | current) over the sample estimates the entropy rate
    empirical = -P[tokens[:-1], tokens[1:]].log().mean().item()
    assert empirical == pytest.approx(ideal, abs=0.02)
    assert 0.5 < ideal < torch.log(torch.tensor(8.0)).item()   # 8 successors per token: below ln 8
    # deterministic in the seed
    assert torch.equal(tokens[:1000], synthetic_corpus(1000, vocab_size=64, seed=1).tokens)
    assert not torch.equal(tokens[:1000], synthetic_corpus(1000, vocab_size=64, seed=2).tokens)


def test_synthetic_iid_ideal_loss_matches_empirical():
    tokens, ideal = synthetic_corpus(100_000, vocab_size=16, seed=0, kind="iid")
    p = torch.bincount(tokens, minlength=16).double() / tokens.numel()
    empirical = -(p * p.log()).sum().item()
    assert empirical == pytest.approx(ideal, abs=0.01)
    with pytest.raises(ValueError, match="kind='zipf'"):
        synthetic_corpus(10, kind="zipf")


@pytest.fixture(scope="module")
def tokens():
    return torch.arange(1000) % 251


def test_get_batch_shift_and_determinism(tokens):
    x, y = get_batch(tokens, batch_size=4, seq_len=16, step=3)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], (x[:, -1] + 1) % 251)        # y is the next token in the stream
    x2, y2 = get_batch(tokens, batch_size=4, seq_len=16, step=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, get_batch(tokens, 4, 16, step=4)[0])
    assert not torch.equal(x, get_batch(tokens, 4, 16, step=3, seed=1)[0])
    xu, _ = get_batch(text_corpus(max_bytes=4096), 2, 8, step=0)   # uint8 corpus -> int64 batch
    assert xu.dtype == torch.long


@pytest.mark.parametrize("world_size", [2, 4])
def test_get_batch_shards_concatenate_to_global_batch(tokens, world_size):
    for step in range(3):
        gx, gy = get_batch(tokens, 8, 16, step, seed=7)
        parts = [get_batch(tokens, 8, 16, step, rank=r, world_size=world_size, seed=7) for r in range(world_size)]
        assert all(px.shape == (8 // world_size, 16) for px, _ in parts)
        assert torch.equal(torch.cat([px for px, _ in parts]), gx)
        assert torch.equal(torch.cat([py for _, py in parts]), gy)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=6, world_size=4), "batch_size=6 is not divisible by world_size=4"),
    (dict(rank=2, world_size=2), "rank=2 must be in"),
    (dict(seq_len=1000), "need at least 1001"),
    (dict(step=-1), "step=-1"),
    (dict(batch_size=0), "batch_size=0"),
])
def test_get_batch_errors(tokens, kwargs, match):
    args = dict(batch_size=8, seq_len=16, step=0) | kwargs
    with pytest.raises(ValueError, match=match):
        get_batch(tokens, **args)
