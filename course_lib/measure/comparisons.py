"""Comparisons as data (issue 18): a measurement beside its formula or its library twin, printed and recorded.

Every place a lesson puts a number next to what it should be (bytes sent vs 2(n-1)/n x S, the bubble vs
(p-1)/(m+p-1), memory vs the ZeRO formula, the course's DDP vs torch DDP, ...) calls `compare`:

    >>> c = compare("ring all-reduce bytes, rank 0, n=4", 6.0e6, 6.0e6, unit="B", against="2(n-1)/n x S",
    ...             hardware="CPU: AMD EPYC, 2 cores, gloo")       # doctest: +SKIP
    ring all-reduce bytes, rank 0, n=4: 6e+06 B vs 6e+06 B (2(n-1)/n x S), within 5 %: pass | CPU: AMD EPYC, ...

The check is ``|measured - expected| <= atol + rtol * |expected|``, or ``lo <= measured <= hi`` when ``expected``
is a range ``(lo, hi)`` (a speed that must land in a band). A measurement that could not be taken here is NaN:
``not run``. Records go to `recorded()` in this process and, when ``$COURSE_COMPARISONS`` names a file (``course
run`` and ``course lab-report`` set it for each lesson's kernel), one JSON line each into it: the records of a run
lie beside its executed notebook, and `course lab-report` turns them into its table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

__all__ = ["Comparison", "compare", "recorded", "load", "ENV"]

ENV = "COURSE_COMPARISONS"
_RECORDS: list["Comparison"] = []


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One measurement against its reference. ``expected``: a number (with ``rtol``/``atol``) or a range (lo, hi);
    ``against``: what the reference is (a formula, ``torch DDP``, a datasheet row); ``lesson``: where it was taken."""

    name: str
    measured: float
    expected: float | tuple[float, float]
    rtol: float = 0.05
    atol: float = 0.0
    unit: str = ""
    against: str = "formula"
    hardware: str = ""
    lesson: str = ""

    @property
    def status(self) -> str:
        """``pass``, ``out of tolerance`` or ``not run`` (the measurement is NaN)."""
        if self.measured is None or math.isnan(self.measured):
            return "not run"
        if isinstance(self.expected, (tuple, list)):
            lo, hi = self.expected
            ok = lo <= self.measured <= hi
        else:
            ok = abs(self.measured - self.expected) <= self.atol + self.rtol * abs(self.expected)
        return "pass" if ok else "out of tolerance"

    @property
    def ok(self) -> bool | None:
        """True (pass), False (out of tolerance), None (not run)."""
        return {"pass": True, "out of tolerance": False}.get(self.status)

    def tolerance(self) -> str:
        """The tolerance in words: ``within 5 %``, ``within 0.01 MB``, ``in [1, 2] x``, ``exact``."""
        if isinstance(self.expected, (tuple, list)):
            return f"in [{self.expected[0]:.4g}, {self.expected[1]:.4g}]" + (f" {self.unit}" if self.unit else "")
        parts = [f"{self.rtol * 100:g} %"] if self.rtol else []
        parts += [f"{self.atol:.3g}" + (f" {self.unit}" if self.unit else "")] if self.atol else []
        return "within " + " + ".join(parts) if parts else "exact"

    def expected_text(self) -> str:
        if isinstance(self.expected, (tuple, list)):
            return f"{self.expected[0]:.4g}-{self.expected[1]:.4g}"
        return f"{self.expected:.6g}"

    def line(self) -> str:
        """One printed line: name, measured vs expected (reference), tolerance, verdict, hardware."""
        unit = f" {self.unit}" if self.unit else ""
        where = f" | {self.hardware}" if self.hardware else ""
        return (f"{self.name}: {self.measured:.6g}{unit} vs {self.expected_text()}{unit} ({self.against}), "
                f"{self.tolerance()}: {self.status}{where}")

    def _repr_pretty_(self, printer, cycle) -> None:
        """Short in a notebook (`compare` printed the full line already): ``<pass: name>``."""
        printer.text(f"<{self.status}: {self.name}>")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["expected"] = list(self.expected) if isinstance(self.expected, (tuple, list)) else self.expected
        d["measured"] = None if self.measured is None or math.isnan(self.measured) else self.measured
        d["status"] = self.status
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Comparison":
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["measured"] = math.nan if kw.get("measured") is None else float(kw["measured"])
        if isinstance(kw.get("expected"), list):
            kw["expected"] = tuple(kw["expected"])
        return cls(**kw)


def _lesson() -> str:
    """The lesson whose kernel this is: ``$COURSE_LESSON`` (set by ``course run`` / ``lab-report``), else ''."""
    return os.environ.get("COURSE_LESSON", "")


def compare(name: str, measured: float, expected: float | tuple[float, float], *, rtol: float = 0.05,
            atol: float = 0.0, unit: str = "", against: str = "formula", hardware: str,
            quiet: bool = False) -> Comparison:
    """Record ``measured`` against ``expected`` (see the module docstring), print its line unless ``quiet``, and
    return it. ``hardware`` is required: every figure names where it was measured (`hardware.hardware_label`)."""
    if not name or not isinstance(name, str):
        raise ValueError("compare: name must be a non-empty string, e.g. 'ring all-reduce bytes, n=4'")
    if not hardware:
        raise ValueError(f"compare({name!r}): hardware is required, e.g. hardware.hardware_label('gloo')")
    if isinstance(expected, (tuple, list)) and (len(expected) != 2 or expected[0] > expected[1]):
        raise ValueError(f"compare({name!r}): a range must be (lo, hi) with lo <= hi, got {expected!r}")
    if rtol < 0 or atol < 0:
        raise ValueError(f"compare({name!r}): rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    measured = math.nan if measured is None else float(measured)
    expected = tuple(float(x) for x in expected) if isinstance(expected, (tuple, list)) else float(expected)
    c = Comparison(name, measured, expected, float(rtol), float(atol), unit, against, hardware, _lesson())
    _RECORDS.append(c)
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(c.to_dict()) + "\n")
    if not quiet:
        print(c.line(), flush=True)
    return c


def recorded() -> list[Comparison]:
    """The comparisons recorded in this process so far."""
    return list(_RECORDS)


def load(path: str | Path) -> list[Comparison]:
    """The comparisons in a JSON-lines file written through ``$COURSE_COMPARISONS`` (missing file: none)."""
    path = Path(path)
    if not path.exists():
        return []
    return [Comparison.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
