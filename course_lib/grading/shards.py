"""A class split over a cluster: ``course grade --shard K/N`` and ``course grade merge RESULTS...``.

The class is the sorted list of `grade.find_submissions` (the order of ``--jobs 1``); shard K of N takes every
N-th submission of it, starting at the K-th (round robin: shards differ by at most one submission, and each gets
its share of every part of the alphabet). A shard's JSON records, beside its results, the shard spec and the whole
class (student and file of each submission, in order, and a digest of that list), so that `merge` can tell a
missing shard from a missing student:

    {"shard": "2/3", "class": [["alice", "class/alice/nb.ipynb"], ...], "class_digest": "...", "results": [...]}

`merge` refuses, naming the students: a submission graded in two shards' files, a submission of the class graded
in none (a shard not given, or lost), files of different classes or different N. It returns the results in the
class's order: the same list one ``course grade`` of the whole class writes (docs/GRADING.md, "A class on a
cluster", has the SLURM job array script).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

SPEC_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


class ShardError(ValueError):
    """A shard spec or a set of shard files that cannot be used: the message names the field, or the students."""


@dataclass(frozen=True)
class Shard:
    """The K-th (1-based) of N slices of a class."""

    k: int
    n: int

    def __post_init__(self):
        if self.n < 1:
            raise ShardError(f"--shard {self.k}/{self.n}: N must be at least 1 (the number of shards)")
        if not 1 <= self.k <= self.n:
            raise ShardError(f"--shard {self.k}/{self.n}: K must be between 1 and N={self.n} (K counts from 1, "
                             f"e.g. $SLURM_ARRAY_TASK_ID of --array=1-{self.n})")

    @classmethod
    def parse(cls, spec: str) -> "Shard":
        """``"2/3"`` -> Shard(2, 3); anything else raises `ShardError` saying the form."""
        m = SPEC_RE.match(str(spec))
        if not m:
            raise ShardError(f"--shard {spec!r}: give K/N, the K-th of N slices, K from 1 to N (e.g. --shard 2/3)")
        return cls(int(m.group(1)), int(m.group(2)))

    def pick(self, items: list) -> list:
        """This shard's items: positions K-1, K-1+N, K-1+2N, ... of ``items`` (round robin)."""
        return items[self.k - 1::self.n]

    def __str__(self) -> str:
        return f"{self.k}/{self.n}"


def class_digest(members: list[tuple[str, str]]) -> str:
    """A digest of the class: its (student, submission) pairs in order."""
    return hashlib.sha256(json.dumps([list(m) for m in members]).encode()).hexdigest()[:16]


def document(results: list[dict], shard: Shard, members: list[tuple[str, str]]) -> dict:
    """What a shard writes as its JSON (see the module docstring)."""
    return {"shard": str(shard), "class": [list(m) for m in members], "class_digest": class_digest(members),
            "results": results}


def merge(paths: list[str | Path]) -> list[dict]:
    """The results of the shards' JSON files ``paths`` as one class (the order of the whole class's run).

    Raises `ShardError` when a file is not a shard's, the files are of different classes or shard counts, or a
    submission is graded twice or not at all (naming each student).
    """
    if not paths:
        raise ShardError("merge: give the shards' JSON files (course grade --shard K/N --json FILE)")
    docs = []
    for path in map(Path, paths):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ShardError(f"merge: cannot read {path}: {exc}") from None
        if not isinstance(doc, dict) or not {"shard", "class", "class_digest", "results"} <= set(doc):
            raise ShardError(f"merge: {path} is not a shard's results (written by course grade --shard K/N --json "
                             f"FILE); a whole class's JSON needs no merge")
        docs.append((path, doc))
    first_path, first = docs[0]
    n = Shard.parse(first["shard"]).n
    for path, doc in docs[1:]:
        if doc["class_digest"] != first["class_digest"]:
            raise ShardError(f"merge: {path} and {first_path} grade different classes (their lists of submissions "
                             f"differ: {len(doc['class'])} vs {len(first['class'])} submissions)")
        if Shard.parse(doc["shard"]).n != n:
            raise ShardError(f"merge: {path} is shard {doc['shard']}, {first_path} is shard {first['shard']}: "
                             f"one class is split into one number of shards")
    members = [tuple(m) for m in first["class"]]
    seen: dict[tuple[str, str], Path] = {}
    twice = []
    for path, doc in docs:
        for res in doc["results"]:
            key = (res.get("student"), res["submission"])
            if key in seen:
                twice.append(f"{key[0]} ({key[1]}: in {seen[key]} and {path})")
            seen[key] = path
    if twice:
        raise ShardError(f"merge: graded twice: {'; '.join(twice)}. Give each shard's JSON once")
    strangers = sorted(f"{s} ({f})" for s, f in seen if (s, f) not in set(members))
    if strangers:
        raise ShardError(f"merge: not in the class the shards list: {', '.join(strangers)}")
    missing = [(i, s, f) for i, (s, f) in enumerate(members) if (s, f) not in seen]
    if missing:
        shards = sorted({f"{i % n + 1}/{n}" for i, _, _ in missing})
        raise ShardError(f"merge: not graded in any file given: {', '.join(f'{s} ({f})' for _, s, f in missing)}; "
                         f"they belong to shard {', '.join(shards)}: give its JSON (or rerun it)")
    by_key = {(res.get("student"), res["submission"]): res for _, doc in docs for res in doc["results"]}
    return [by_key[m] for m in members]
