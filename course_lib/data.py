"""Data for the course, all available offline on every machine (lesson 00; sharding in lesson 02).

* `ByteTokenizer`: text <-> UTF-8 bytes, a vocabulary of 256 (no merges, no files to download).
* `text_corpus()`: real text -- the Python standard library's own source files.
* `synthetic_corpus()`: tokens from a Markov chain whose best achievable loss (its entropy rate) is
  known exactly, so a training run can be judged against a number rather than by eye.
* `get_batch()`: a deterministic, rank-sharded batch sampler for data parallelism: rank r of
  world_size W gets rows [r*B/W, (r+1)*B/W) of the global batch of step `step` of a corpus.
* `random_batches()`: global batches of uniformly random token ids, the same on every rank for a seed: the
  data of every experiment that compares a parallel run with one process (the content does not matter
  there, only that every run sees the same numbers). `shard_batch()` gives a rank its rows.
* `WindowLoader`: the training script's loader (lesson 09): a finite dataset of token windows, shuffled anew each
  epoch, whose position (epoch, batch) is its `state_dict`: it goes into every checkpoint, so a resumed run reads
  on where it stopped, and `skip` moves it past batches (spike recovery); optional padding of each sequence.
"""

from __future__ import annotations

import bisect
import math
import os
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

__all__ = ["ByteTokenizer", "text_corpus", "SyntheticCorpus", "synthetic_corpus",
           "markov_transition_matrix", "get_batch", "random_batches", "WindowLoader"]


class ByteTokenizer:
    """Byte-level tokenizer: a token is one byte of the UTF-8 encoding, so vocab_size = 256.

    Any text round-trips exactly; decode() replaces invalid byte sequences (which a model may sample)
    with U+FFFD instead of failing.
    """

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """str -> list of ints in 0..255."""
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """str -> 1-D tensor of byte values (int64 by default, ready for nn.Embedding)."""
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(dtype)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """list / 1-D tensor of ints in 0..255 -> str."""
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        bad = [i for i in ids if not 0 <= int(i) < 256]
        if bad:
            raise ValueError(f"token ids must be bytes in 0..255; got {bad[:5]}")
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


# ---- real text: the standard library's source ---------------------------------------------------

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib"}
_CORPUS_CACHE: dict = {"data": b"", "complete": False}


def _stdlib_files() -> list[Path]:
    """The .py files under the directory of `os.__file__`, sorted by path, skipping installed
    packages and test suites (which differ between distributions of the same Python)."""
    root = Path(os.__file__).resolve().parent
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_corpus(max_bytes: int | None = None) -> torch.Tensor:
    """A real text corpus, with no download: the Python standard library's .py source files.

    Files come from the directory of `os.__file__` in sorted path order (site-packages and test
    directories skipped), each preceded by a line `# file: <relative path>`, concatenated. The result
    is a 1-D uint8 tensor of bytes (tokens of `ByteTokenizer`), cached in memory; `max_bytes` keeps
    only the first max_bytes bytes (and reads only as many files as needed).

    Deterministic on one machine; the content depends on the Python version (3.12's stdlib differs
    from 3.11's), so print `sys.version` next to any number measured on it.
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                  or max_bytes <= 0):
        raise ValueError(f"max_bytes={max_bytes!r} must be a positive int or None")
    cache = _CORPUS_CACHE
    if not cache["complete"] and (max_bytes is None or len(cache["data"]) < max_bytes):
        root = Path(os.__file__).resolve().parent
        chunks, size = [], 0
        complete = True
        for path in _stdlib_files():
            chunk = f"# file: {path.relative_to(root).as_posix()}\n".encode() + path.read_bytes()
            if not chunk.endswith(b"\n"):
                chunk += b"\n"
            chunks.append(chunk)
            size += len(chunk)
            if max_bytes is not None and size >= max_bytes:
                complete = False
                break
        cache["data"], cache["complete"] = b"".join(chunks), complete
    data = cache["data"] if max_bytes is None else cache["data"][:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# ---- synthetic data with a known answer ----------------------------------------------------------

class SyntheticCorpus(NamedTuple):
    """tokens: 1-D int64 tensor; ideal_loss: the lowest achievable mean cross-entropy, in nats."""

    tokens: torch.Tensor
    ideal_loss: float


def markov_transition_matrix(vocab_size: int, seed: int = 0, branching: int = 8) -> torch.Tensor:
    """The (V, V) float64 transition matrix P[a, b] = p(next=b | current=a) used by synthetic_corpus.

    Each token has `branching` possible successors (chosen at random) with Dirichlet(1) weights.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size} must be >= 2")
    k = min(branching, vocab_size)
    g = torch.Generator().manual_seed(seed)
    P = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    for a in range(vocab_size):
        succ = torch.randperm(vocab_size, generator=g)[:k]
        w = -torch.log(torch.rand(k, generator=g, dtype=torch.float64))   # Exp(1) -> Dirichlet(1)
        P[a, succ] = w / w.sum()
    return P


def _stationary(P: torch.Tensor) -> torch.Tensor:
    """Stationary distribution pi = pi P (left eigenvector for eigenvalue 1)."""
    evals, evecs = torch.linalg.eig(P.T)
    pi = evecs[:, torch.argmin((evals - 1).abs())].real
    pi = pi / pi.sum()
    return pi.clamp_min(0) / pi.clamp_min(0).sum()


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last dimension (0 log 0 = 0)."""
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


def synthetic_corpus(n_tokens: int, vocab_size: int = 256, seed: int = 0, kind: str = "markov",
                     branching: int = 8) -> SyntheticCorpus:
    """Tokens whose ideal loss is known exactly (lesson 00: "is my training run any good?").

    kind="markov": a first-order Markov chain with transition matrix
        P = markov_transition_matrix(vocab_size, seed, branching), started from its stationary
        distribution pi. No model can beat its entropy rate  H = -sum_a pi_a sum_b P_ab ln P_ab  (nats),
        and a model that sees the previous token can reach it.
    kind="iid": independent tokens from a random unigram distribution p; ideal loss = H(p).

    Returns SyntheticCorpus(tokens (n_tokens,) int64, ideal_loss float); unpack as `tokens, ideal = ...`.
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens <= 0:
        raise ValueError(f"n_tokens={n_tokens!r} must be a positive int")
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size} must be >= 2")
    g = torch.Generator().manual_seed(seed + 1_000_003)   # independent of the matrix's stream
    if kind == "iid":
        w = -torch.log(torch.rand(vocab_size, generator=torch.Generator().manual_seed(seed),
                                  dtype=torch.float64))
        p = w / w.sum()
        tokens = torch.multinomial(p, n_tokens, replacement=True, generator=g)
        return SyntheticCorpus(tokens, float(_entropy(p)))
    if kind != "markov":
        raise ValueError(f"kind={kind!r} is unknown: pick 'markov' or 'iid'")
    P = markov_transition_matrix(vocab_size, seed, branching)
    pi = _stationary(P)
    ideal = float((pi * _entropy(P)).sum())
    # Sample the chain: inverse-CDF on each row's cumulative probabilities (a plain loop: clear and fast enough).
    cum = P.cumsum(-1)
    cum[:, -1] = 1.0
    cum_rows = cum.tolist()
    u = torch.rand(n_tokens, generator=g, dtype=torch.float64).tolist()
    state = bisect.bisect_right(pi.cumsum(0).tolist(), u[0])
    state = min(state, vocab_size - 1)
    out = [state]
    for t in range(1, n_tokens):
        state = bisect.bisect_right(cum_rows[state], u[t])
        out.append(state)
    return SyntheticCorpus(torch.tensor(out, dtype=torch.long), ideal)


# ---- batches, sharded over data-parallel ranks (lesson 02) ------------------------------------------

def get_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, step: int, rank: int = 0,
              world_size: int = 1, seed: int = 0, device: torch.device | str | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s share of the global batch of training step `step`.

    The global batch is `batch_size` windows of seq_len + 1 tokens whose start offsets are drawn from
    a generator seeded by (seed, step) alone: every rank computes the same offsets, with no
    communication, and takes rows [rank * b, (rank + 1) * b) with b = batch_size // world_size.
    So concatenating the ranks' x in rank order gives exactly the world_size=1 batch.

    Returns x, y: (b, seq_len) int64 each, y = x shifted left by one token (the next-token targets).
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise ValueError("tokens must be a 1-D tensor of token ids (e.g. text_corpus() or synthetic_corpus().tokens)")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size})")
    if batch_size % world_size:
        raise ValueError(
            f"batch_size={batch_size} is not divisible by world_size={world_size}: "
            f"use a global batch_size that is a multiple of {world_size}"
        )
    n_windows = tokens.numel() - seq_len          # valid start offsets: 0 .. len - seq_len - 1
    if n_windows <= 0:
        raise ValueError(
            f"tokens has {tokens.numel()} tokens, too few for seq_len={seq_len}: need at least {seq_len + 1}"
        )
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63 - 1))
    starts = torch.randint(0, n_windows, (batch_size,), generator=g)   # same on every rank
    b = batch_size // world_size
    starts = starts[rank * b:(rank + 1) * b]                            # this rank's shard
    offsets = starts[:, None] + torch.arange(seq_len + 1)              # (b, T+1)
    window = tokens[offsets].long()                                    # (b, T+1)
    x, y = window[:, :-1], window[:, 1:]                                # (b, T), (b, T)
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def random_batches(cfg, global_batch: int, steps: int = 1, seed: int = 0,
                   seq_len: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches (x, y) of uniformly random token ids in ``0..cfg.vocab_size-1``, each (B, T)
    with B = global_batch and T = seq_len or cfg.seq_len; y is x shifted by one (next-token targets of one
    random sequence of T+1 tokens). The same on every rank for a seed (lesson 02)."""
    g = torch.Generator().manual_seed(seed)
    T = seq_len or cfg.seq_len
    out = []
    for _ in range(steps):
        seq = torch.randint(cfg.vocab_size, (global_batch, T + 1), generator=g)   # (B, T+1)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))          # (B, T), (B, T)
    return out


def shard_batch(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s rows of a global batch: (B, ...) -> (B/world, ...). B must divide evenly (lesson 02)."""
    if t.shape[0] % world:
        raise ValueError(f"global batch {t.shape[0]} does not split evenly over {world} ranks: "
                         f"use a multiple of {world}")
    b = t.shape[0] // world
    return t[rank * b:(rank + 1) * b]


# ---- a stateful loader: the training script's data position (lesson 09) ------------------------------

class WindowLoader:
    """Global batches from a finite dataset of token windows, shuffled per epoch, with its position as state.

    The dataset: ``n = (len(tokens) - 1) // seq_len`` windows of seq_len + 1 tokens, window i starting at token
    i * seq_len (x = its first seq_len tokens, y the next-token targets). Epoch e visits them in the order
    ``torch.randperm(n, generator=manual_seed(seed * 1_000_003 + e))``, ``global_batch`` at a time (the last
    incomplete batch of an epoch is dropped, as ``DataLoader(drop_last=True)`` does), then epoch e + 1 reshuffles.

    ``batch = f(seed, step)`` (`get_batch`) makes a resumed run's data position its step: true only while every
    step reads exactly one batch and nothing is ever skipped. A real loader has a position of its own; here it is
    (epoch, batch within the epoch), what `state_dict` returns (JSON: it goes into the checkpoint's ``extra``) and
    `load_state_dict` restores, as torchdata's ``StatefulDataLoader`` does for a PyTorch ``DataLoader``. `skip`
    moves it without reading: PaLM's recovery skips the batches that led to a loss spike.

    ``pad_fraction`` f > 0: sequence j of a batch keeps a length drawn uniformly from [ceil((1 - f) T), T] (from
    the batch's position and the seed: the same on every rank); past it, x is 0 and y is ``ignore_index`` (no loss,
    no token: `course_lib.training.token_loss`). Every rank draws the whole global batch and takes its rows
    (`shard_batch`): ranks' shards concatenated in rank order are the one-process batch.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int = 0,
                 pad_fraction: float = 0.0, ignore_index: int = -100):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise ValueError("WindowLoader: tokens must be a 1-D tensor of token ids (e.g. text_corpus())")
        for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"WindowLoader: {name}={value!r} must be a positive int")
        if not 0.0 <= pad_fraction < 1.0:
            raise ValueError(f"WindowLoader: pad_fraction={pad_fraction!r} must be in [0, 1)")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.pad_fraction, self.ignore_index = pad_fraction, ignore_index
        self.n_windows = (tokens.numel() - 1) // seq_len
        self.batches_per_epoch = self.n_windows // global_batch
        if self.batches_per_epoch < 1:
            raise ValueError(f"WindowLoader: {tokens.numel()} tokens make {self.n_windows} windows of "
                             f"seq_len + 1 = {seq_len + 1}, fewer than one global batch of {global_batch}")
        self.epoch, self.batch = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def position(self) -> int:
        """Global batches read (or skipped) since the start: the index of the next one."""
        return self.epoch * self.batches_per_epoch + self.batch

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % (2**63 - 1))
            self._order = (self.epoch, torch.randperm(self.n_windows, generator=g))
        return self._order[1]

    def skip(self, n: int) -> None:
        """Move past ``n`` global batches without reading them."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"WindowLoader.skip: n={n!r} must be an int >= 0")
        self.epoch, self.batch = divmod(self.position + n, self.batches_per_epoch)

    def next(self, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s rows of the next global batch, and advance: x, y (global_batch / world_size, seq_len)."""
        rows = self._epoch_order()[self.batch * self.global_batch:(self.batch + 1) * self.global_batch]
        offsets = rows[:, None] * self.seq_len + torch.arange(self.seq_len + 1)         # (B, T+1)
        window = self.tokens[offsets].long()                                           # (B, T+1)
        x, y = window[:, :-1].clone(), window[:, 1:].clone()                           # (B, T), (B, T)
        if self.pad_fraction > 0:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + 7919 * self.position + 1) % (2**63 - 1))
            shortest = max(1, math.ceil((1.0 - self.pad_fraction) * self.seq_len))
            lengths = torch.randint(shortest, self.seq_len + 1, (self.global_batch,), generator=g)   # (B,)
            pad = torch.arange(self.seq_len) >= lengths[:, None]                       # (B, T) True at padding
            x, y = x.masked_fill(pad, 0), y.masked_fill(pad, self.ignore_index)
        self.skip(1)
        return shard_batch(x, rank, world_size), shard_batch(y, rank, world_size)

    def state_dict(self) -> dict:
        """JSON-ready: the position and what it means (the settings that fix the order)."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "n_windows": self.n_windows,
                "global_batch": self.global_batch, "pad_fraction": self.pad_fraction}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        differ = [k for k in ("seed", "n_windows", "global_batch", "pad_fraction") if state[k] != mine[k]]
        if differ:
            raise ValueError(f"WindowLoader: the saved position is for {', '.join(f'{k}={state[k]}' for k in differ)}"
                             f", this loader has {', '.join(f'{k}={mine[k]}' for k in differ)}: the same position "
                             f"would be other data; resume with the same data settings")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
