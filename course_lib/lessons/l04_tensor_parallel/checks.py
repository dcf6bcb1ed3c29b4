"""What the graded exercises of lesson 04 call (solutions/04_tensor_parallel.ipynb): a rank-side harness.

The learner writes, with the signatures below, and the test cells pass them to `rank_try_all` on gloo ranks:

    ColumnParallel(full: nn.Linear, group=None)    weight (out/t, in) = rows of full.weight, bias (out/t)
    RowParallel(full: nn.Linear, group=None)       weight (out, in/t) = columns of full.weight, bias (out) whole
    ParallelMLP(mlp: course_lib.model.MLP, group=None)                 .fc column-parallel, .proj row-parallel
    vocab_parallel_cross_entropy(local_logits (B, T, V/t), targets (B, T), group=None) -> mean loss

Every check compares with the full layer on one process (each rank computes it itself) and counts the
collectives forward and backward (`CollectiveCounter`), so a missing all-reduce, an all-reduce in the wrong
direction or a wrong shard fails with a one-line message that says which. All checks of several exercises
run in one launch (`launch`): each rank returns a list of records, and `check_records` turns them into `check_*`
calls. A failure inside one exercise is recorded, and the others still run. The test cells of the second exercise
of a launch call `launch(..., reuse=True)`: the records of the first cell's launch when it ran the same answers
(the same objects), a launch of their own otherwise, so that every exercise's test cells also run on their own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import dist as cdist
from course_lib.measure.collective_counter import CollectiveCounter
from course_lib.config import ModelConfig
from course_lib.lessons.errors import relative_error
from course_lib.lessons.l04_tensor_parallel.experiments import tp_group
from course_lib.lessons.rank_records import RankRecords, replay_records
from course_lib.model import MLP
from course_lib.reference import reference_for
from course_lib.runtime.launch import RunResult, run

__all__ = ["launch", "rank_try_all", "check_records", "reference_impls", "wrong_impls", "EXERCISES"]

EXERCISES = {"column": "04-column-parallel", "row": "04-row-parallel", "mlp": "04-parallel-mlp",
             "vocab_ce": "04-vocab-ce"}
B, T, IN, OUT, V = 2, 4, 12, 16, 32     # in != out, so a shard along the wrong dimension has the wrong shape


def _calls(counter: CollectiveCounter, phase: str) -> dict:
    return {op: row["calls"] for (p, op), row in sorted(counter.table().items()) if p == phase}


def _inputs(shape, seed, dev):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dev)


def _counted_step(layer, x, w):
    """Forward and backward of sum(layer(x) * w), with the collectives of each phase counted."""
    counter = CollectiveCounter()
    with counter:
        with counter.phase("forward"):
            y = layer(x)
        with counter.phase("backward"):
            (y * w).sum().backward()
    return y, counter


def _try_column(cls, rec, group, dev):
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    full = nn.Linear(IN, OUT).to(dev)
    x, w = _inputs((B, T, IN), 1, dev), _inputs((B, T, OUT), 2, dev)       # loss = sum(y * w)
    xr = x.clone().requires_grad_()
    (full(xr) * w).sum().backward()
    n = OUT // tp
    rows = slice(r * n, (r + 1) * n)
    layer = cls(full, group)
    rec.add("equal", "shape of the weight shard", list(layer.weight.shape), [n, IN],
            "a column-parallel layer keeps a band of the OUTPUT features; nn.Linear's weight is (out, in)")
    rec.add("close", "weight shard = this rank's rows of the full weight (relative error)",
            relative_error(layer.weight.detach(), full.weight.detach()[rows]), 0.0,
            "the exercise text: which rows, in which order")
    xl = x.clone().requires_grad_()
    y, counter = _counted_step(layer, xl, w[..., rows])
    rec.add("equal", "collectives in forward", _calls(counter, "forward"), {},
            "f is the identity in forward: the input is already on every rank (put the all-reduce in backward)")
    rec.add("equal", "collectives in backward", _calls(counter, "backward"), {"all_reduce": 1},
            "f's backward must all-reduce the input gradient: each rank holds only its output columns' part")
    rec.add("close", "output = this rank's columns of the full output (relative error)",
            relative_error(y.detach(), full(x).detach()[..., rows]), 0.0,
            "this rank's slice of the full layer, its input passed through f (lesson 04, the f and g operators)")
    rec.add("close", "input gradient = one process's (relative error)", relative_error(xl.grad, xr.grad), 0.0,
            "f's backward sums the partial input gradients of all ranks (dist.all_reduce)")
    rec.add("close", "weight gradient = this rank's rows of one process's (relative error)",
            relative_error(layer.weight.grad, full.weight.grad[rows]), 0.0,
            "the exercise text: which part of the weight and of the bias a rank keeps")


def _try_row(cls, rec, group, dev):
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    full = nn.Linear(OUT, IN).to(dev)                                   # 16 -> 12
    x, w = _inputs((B, T, OUT), 3, dev), _inputs((B, T, IN), 4, dev)
    xr = x.clone().requires_grad_()
    (full(xr) * w).sum().backward()
    n = OUT // tp
    cols = slice(r * n, (r + 1) * n)
    layer = cls(full, group)
    rec.add("equal", "shape of the weight shard", list(layer.weight.shape), [IN, n],
            "a row-parallel layer keeps a band of the INPUT features; nn.Linear's weight is (out, in)")
    rec.add("close", "weight shard = this rank's columns of the full weight (relative error)",
            relative_error(layer.weight.detach(), full.weight.detach()[:, cols]), 0.0,
            "the exercise text: which columns, in which order")
    xl = x[..., cols].clone().requires_grad_()                          # this rank's input features
    y, counter = _counted_step(layer, xl, w)
    rec.add("equal", "collectives in forward", _calls(counter, "forward"), {"all_reduce": 1},
            "g all-reduces the partial outputs in forward (each rank computed x_r W_r^T, a partial sum)")
    rec.add("equal", "collectives in backward", _calls(counter, "backward"), {},
            "g is the identity in backward: the output gradient is already the same on every rank")
    rec.add("close", "output = one process's full output (relative error)", relative_error(y.detach(), full(x).detach()), 0.0,
            "sum the partial outputs with g, then add the bias once (after the sum, not on every rank)")
    rec.add("close", "input gradient = this rank's columns of one process's (relative error)",
            relative_error(xl.grad, xr.grad[..., cols]), 0.0,
            "no communication in backward: lesson 04's table of the f and g operators")
    rec.add("close", "weight gradient = this rank's columns of one process's (relative error)",
            relative_error(layer.weight.grad, full.weight.grad[:, cols]), 0.0,
            "the exercise text: which part of the weight a rank keeps")
    rec.add("close", "bias gradient = one process's (relative error)",
            relative_error(layer.bias.grad, full.bias.grad), 0.0, "the bias is whole on every rank and added after the sum")


def _try_mlp(cls, rec, group, dev):
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    cfg = ModelConfig(vocab_size=32, seq_len=T, n_layer=1, n_head=4, d_model=8, d_ff=16)
    torch.manual_seed(0)
    full = MLP(cfg).to(dev)
    x, w = _inputs((B, T, 8), 5, dev), _inputs((B, T, 8), 6, dev)
    xr = x.clone().requires_grad_()
    (full(xr) * w).sum().backward()
    n = cfg.d_ff // tp
    layer = cls(full, group)
    xl = x.clone().requires_grad_()
    counter = CollectiveCounter()
    with counter:
        with counter.phase("forward"):
            y = layer(xl)
        with counter.phase("backward"):
            (y * w).sum().backward()
    rec.add("equal", "collectives in forward", _calls(counter, "forward"), {"all_reduce": 1},
            "column then row: the only forward all-reduce is g's, after proj; GELU needs no communication")
    rec.add("equal", "collectives in backward", _calls(counter, "backward"), {"all_reduce": 1},
            "the only backward all-reduce is f's, before fc")
    rec.add("close", "output = one process's MLP (relative error)", relative_error(y.detach(), full(x).detach()), 0.0,
            "fc column-parallel, GELU (approximate='tanh') on the local F/t features, proj row-parallel")
    rec.add("close", "input gradient = one process's (relative error)", relative_error(xl.grad, xr.grad), 0.0,
            "fc must be column-parallel (f before it), proj row-parallel (g after it)")
    rec.add("close", "fc weight gradient = this rank's rows (relative error)",
            relative_error(layer.fc.weight.grad, full.fc.weight.grad[r * n:(r + 1) * n]), 0.0,
            "fc is the column-parallel layer (exercise 04-column-parallel)")
    rec.add("close", "proj weight gradient = this rank's columns (relative error)",
            relative_error(layer.proj.weight.grad, full.proj.weight.grad[:, r * n:(r + 1) * n]), 0.0,
            "proj is the row-parallel layer (exercise 04-row-parallel)")


def _try_vocab_ce(fn, rec, group, dev):
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    logits = _inputs((B, 2 * T, V), 7, dev) * 3                        # 16 tokens
    # half of the targets are the first and last ids of every rank's columns at tp = 2 and 4 (who owns a
    # boundary id is where an off-by-one shows), the other half random
    edges = [i * V // 4 + d for i in range(4) for d in (0, V // 4 - 1)]
    gen = torch.Generator().manual_seed(8)
    targets = torch.cat([torch.tensor(edges), torch.randint(0, V, (2 * B * T - len(edges),), generator=gen)])
    targets = targets[torch.randperm(targets.numel(), generator=gen)].view(B, 2 * T).to(dev)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, 1), targets.flatten())
    ref.backward()
    n = V // tp
    cols = slice(r * n, (r + 1) * n)
    local = logits[..., cols].clone().requires_grad_()                 # this rank's vocabulary columns
    counter = CollectiveCounter()
    with counter:
        with counter.phase("forward"):
            loss = fn(local, targets, group)
        with counter.phase("backward"):
            loss.backward()
    rec.add("close", "loss = F.cross_entropy of the full logits", float(loss), float(ref), "the sum of "
            "exponentials runs over the whole vocabulary, on ALL ranks; each target id belongs to one rank only", tol=1e-5)
    rec.add("close", "gradient of the local logits = this rank's columns of one process's (relative error)",
            relative_error(local.grad, full.grad[..., cols]), 0.0,
            "the exercise's rules on the sums that cross ranks and on m")
    with torch.no_grad():                       # exp(100) overflows fp32: a loss that skips the shift by m is inf/nan
        big = logits + 100.0
        ref_big = F.cross_entropy(big.flatten(0, 1), targets.flatten())
        loss_big = fn(big[..., cols].clone(), targets, group)
    rec.add("close", "loss with every logit raised by 100 (exp(100) is inf in fp32) = F.cross_entropy's",
            float(loss_big), float(ref_big), "the exercise's rule on m: what is it there for?", tol=1e-4)
    moved = counter.bytes()
    rec.add("equal", "no rank gathers the full logits (bytes communicated < the local logits' size)",
            moved < local.numel() * local.element_size(), True,
            "the exercise's first rule: only per-token numbers cross between ranks")


_TRIALS = {"column": _try_column, "row": _try_row, "mlp": _try_mlp, "vocab_ce": _try_vocab_ce}


def rank_try_all(impls: dict, tps=(2, 4)) -> list[dict]:
    """Run the checks of every exercise in `impls` ({"column": cls, "row": cls, "mlp": cls, "vocab_ce": fn};
    a key may carry a label, "column/missing all-reduce", to check several answers to one exercise)
    for each tp (groups of tp consecutive ranks); returns this rank's records (see `check_records`)."""
    dev = cdist.device()
    records = []
    for tp in tps:
        group = tp_group(tp)
        for key, impl in impls.items():
            kind, _, variant = key.partition("/")           # "column" or "column/a label" (tests of wrong answers)
            rec = RankRecords(EXERCISES[kind], where=f"tp={tp}, ", tp=tp, variant=variant)
            try:
                _TRIALS[kind](impl, rec, group, dev)
            except Exception as exc:  # noqa: BLE001 - a learner's error becomes a failed check, not a crash
                rec.error(exc)
            records += rec.items
    return records


_LAUNCHES: list = []     # (answers, nprocs, backend, RunResult) of this kernel's launches, newest last


def launch(impls: dict, nprocs: int, backend: str, *, helpers: tuple = (), reuse: bool = False,
           timeout_s: float = 180) -> RunResult:
    """`run(rank_try_all, nprocs, args=(impls,))`: the records of every exercise in ``impls`` on every rank.

    ``helpers``: the other objects of the answer cells (the f and g operators), part of what counts as "the same
    answers". ``reuse``: return the result of an earlier launch of exactly these objects (identity, not equality,
    so a cell run again is launched again) on the same ranks, if any; the first test cell of a launch passes
    False, so that running it again always runs the learner's code again."""
    answers = tuple(sorted(impls.items())) + tuple(("helper", h) for h in helpers)
    if reuse:
        for seen, n, b, result in reversed(_LAUNCHES):
            if (n, b) == (nprocs, backend) and len(seen) == len(answers) and all(
                    k1 == k2 and v1 is v2 for (k1, v1), (k2, v2) in zip(seen, answers)):
                return result
    result = run(rank_try_all, nprocs=nprocs, args=(dict(impls),), backend=backend, timeout_s=timeout_s,
                 stream=False)
    _LAUNCHES.append((answers, nprocs, backend, result))
    del _LAUNCHES[:-8]                      # a few: the objects they hold stay alive, so identity stays meaningful
    return result


def check_records(returns: list, exercise: str, tps=None) -> int:
    """Every rank's records of `exercise` (only those of the tp values in `tps`, when given) as check_* calls
    (`rank_records.replay_records`: the first failure raises `CheckFailed` with a one-line message). Returns the
    number of checks that passed."""
    return replay_records(returns, exercise, keep=None if tps is None else (lambda rec: rec["tp"] in tps))


# ------------------------------------------------------------------ reference and wrong answers (tests)

@reference_for("04-column-parallel")
def _column(full, group=None):
    from course_lib.parallel.tensor import ColumnParallelLinear
    return ColumnParallelLinear.from_linear(full, group)


@reference_for("04-row-parallel")
def _row(full, group=None):
    from course_lib.parallel.tensor import RowParallelLinear
    return RowParallelLinear.from_linear(full, group)


@reference_for("04-parallel-mlp")
def _mlp(mlp, group=None):
    from course_lib.parallel.tensor import ParallelMLP
    return ParallelMLP.from_mlp(mlp, group)


def reference_impls() -> dict:
    from course_lib.parallel.vocab import vocab_parallel_cross_entropy
    return {"column": _column, "row": _row, "mlp": _mlp, "vocab_ce": vocab_parallel_cross_entropy}


class _NoAllReduceBackward(torch.autograd.Function):      # wrong f: forgets the backward all-reduce
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceForward(torch.autograd.Function):          # wrong f: all-reduces in forward instead
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _WrongColumn(nn.Module):
    def __init__(self, full, group=None, f=_NoAllReduceBackward, dim=0):
        super().__init__()
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.f = group, f
        self.weight = nn.Parameter(full.weight.detach().chunk(tp, dim)[r].clone())
        self.bias = nn.Parameter(full.bias.detach().chunk(tp, 0)[r].clone())

    def forward(self, x):
        return F.linear(self.f.apply(x, self.group), self.weight, self.bias)


def _local_ce(local_logits, targets, group=None):              # wrong: softmax over this rank's columns only
    r = dist.get_rank(group)
    n = local_logits.shape[-1]
    t = (targets - r * n).clamp(0, n - 1)
    return F.cross_entropy(local_logits.flatten(0, 1), t.flatten())


def wrong_impls() -> dict:
    """One wrong answer per kind of mistake; `tests/test_tensor.py` checks that each fails with a clear message."""
    import functools
    return {"column/missing all-reduce": _WrongColumn,
            "column/all-reduce in forward": functools.partial(_WrongColumn, f=_AllReduceForward),
            "column/wrong shard dim": functools.partial(_WrongColumn, dim=1),
            "row/column layer": _column,
            "mlp/row layers": lambda mlp, group=None: _MLPWith(_row, _row, mlp, group),
            "vocab_ce/local softmax": _local_ce}


class _MLPWith(nn.Module):
    def __init__(self, col, row, mlp, group=None):
        super().__init__()
        self.fc, self.proj = col(mlp.fc, group), row(mlp.proj, group)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))
