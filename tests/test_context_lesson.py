"""Lesson 10's one-process graded checks (course_lib/lessons/l10_context/checks.py): 10-balanced-split accepts every
split that meets its goal and rules (two chunks per rank, each chunk once, equal causal work), not one reference's
order, and rejects the splits that break them with a one-line `CheckFailed`. The ranks' exercises (10-ring-step,
10-ulysses-reshape) and the recorded mistakes of all four run in tests/test_mistakes.py."""

from __future__ import annotations

import pytest
import torch

from course_lib.grading.check import CheckFailed
from course_lib.lessons.l10_context import checks


def merge_lse(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    return (torch.exp(lse_a - safe).unsqueeze(-1) * out_a + torch.exp(lse_b - safe).unsqueeze(-1) * out_b), lse


def masks_for(balanced_chunks):
    """step_masks written against a given split, as a learner's would be."""
    def step_masks(cp, rank, step):
        kind = lambda qc, kc: "full" if kc < qc else "causal" if kc == qc else "skip"   # noqa: E731
        return [[kind(qc, kc) for kc in balanced_chunks(cp, (rank - step) % cp)] for qc in balanced_chunks(cp, rank)]
    return step_masks


VALID = {
    "front and mirror": lambda cp, r: [r, 2 * cp - 1 - r],
    "mirror first": lambda cp, r: [2 * cp - 1 - r, r],
    "pairs dealt from the middle": lambda cp, r: [cp - 1 - r, cp + r],
    "order mixed over ranks": lambda cp, r: [2 * cp - 1 - r, r] if r % 2 else [r, 2 * cp - 1 - r],
}


def test_merge_lse_passes():
    assert len(checks.check_merge_lse(merge_lse)) == 8


@pytest.mark.parametrize("name", VALID)
def test_every_balanced_split_passes(name):
    split = VALID[name]
    work = checks.check_balanced_split(split, masks_for(split))
    assert work == {cp: [2 * cp + 1] * cp for cp in (1, 2, 3, 4)}


@pytest.mark.parametrize("split, match", [
    (lambda cp, r: [2 * r, 2 * r + 1], r"balanced_chunks\(cp=2\): chunk pairs each rank must compute"),
    (lambda cp, r: [r, cp + r], r"balanced_chunks\(cp=2\): chunk pairs each rank must compute"),
    (lambda cp, r: [r, 2 * cp - r], r"balanced_chunks\(cp=1\) over every rank, sorted: each of the 2cp chunks"),
    (lambda cp, r: [0, 2 * cp - 1], r"balanced_chunks\(cp=2\) over every rank, sorted"),
    (lambda cp, r: [r, 2 * cp - 1 - r, cp], r"balanced_chunks\(cp=1, rank=0\): number of chunks"),
], ids=["contiguous", "one-from-each-half", "mirror-off-by-one", "every-rank-the-same", "three-chunks"])
def test_splits_that_break_the_rules_fail(split, match):
    with pytest.raises(CheckFailed, match=match) as err:
        checks.check_balanced_split(split, masks_for(split))
    assert "\n" not in str(err.value) and "Hint:" in str(err.value)


def test_masks_follow_the_learners_own_split():
    """Rows and columns in the order balanced_chunks returns: masks written for [r, 2cp-1-r] do not fit the reverse."""
    with pytest.raises(CheckFailed, match=r"step_masks\(cp=1, rank=0, step=0\) \(rows: my chunks \[1, 0\]"):
        checks.check_balanced_split(VALID["mirror first"], masks_for(VALID["front and mirror"]))


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_ring_step_work_sums_to_the_work_per_rank_and_its_critical_path(cp):
    """Per step and rank (`ring_step_work`): summed over the steps, the course's whole-diagonal count; the per-step
    critical path (sum of each step's slowest rank) is the contiguous split's last rank, 4cp/(2cp+1) times the
    balanced split's with whole diagonals and 2 - 1/cp with a causal flash kernel's half diagonals, while the busiest
    over the least busy rank is cp and 2cp - 1."""
    from course_lib.theory import context
    s = 2 * cp * 16
    for split in ("contiguous", "balanced"):
        steps = context.ring_step_work(s, cp, split)
        assert [sum(col) for col in zip(*steps)] == context.causal_work_per_rank(s, cp, split)
    path = {(sp, d): context.ring_critical_path(s, cp, sp, d) for sp in ("contiguous", "balanced")
            for d in ("whole", "half")}
    assert path["contiguous", "whole"] / path["balanced", "whole"] == pytest.approx(4 * cp / (2 * cp + 1))
    assert path["contiguous", "half"] / path["balanced", "half"] == pytest.approx(2 - 1 / cp)
    half = [sum(col) for col in zip(*context.ring_step_work(s, cp, "contiguous", "half"))]
    assert max(half) / min(half) == 2 * cp - 1 and max(half) == path["contiguous", "half"]
    assert path["balanced", "half"] == s * s / 2 / cp                  # half the s x s scores, split evenly


def test_ring_hiding_tokens():
    from course_lib.theory import context
    assert context.ring_hiding_tokens(312e12, 300e9) == pytest.approx(1040)       # bf16, b F / (2 BW)
    assert context.ring_hiding_tokens(312e12, 300e9, kv_fraction=0.25) == pytest.approx(260)
