"""Copied answers: which answers of a class are near-copies of the course's own code or of a classmate's.

``course grade`` (docs/GRADING.md, "Copied answers") compares, per coding exercise, the code each learner wrote with
- the official solution's answer regions (``solutions/NN_*.ipynb``),
- the course's implementations marked ``@reference_for(exercise)`` (their source, found without importing them),
- the independently written answers of ``solutions/independent/lNN.py``, where there is one,
- every other submission's code for the same exercise.

*The code a learner wrote* (`learner_code`): the submission's code cells of the exercise (those after the previous
exercise's test cells, as the grader assembles them), minus the lines of the student copy's same cells (the given
code: signatures, docstrings, set-up), found with `difflib`. The fingerprints are `copydetect`'s (MOSS's winnowing
over the code as Pygments tokenizes it: every name becomes ``V``, strings ``S``, comments and whitespace go), so
renamed variables, added comments, changed layout and reordered statements leave a copy's fingerprints in place.

A submission's *score* against a source is the share of its code (after that filtering) that the source also holds,
0 to 1: the most similar source is reported, and a score at or above the threshold is *flagged*, for the instructor
to judge; a flag never changes points. An answer shorter than `MIN_CHARS` filtered characters is not scored (two
honest one-liners look alike). The *noise floor* of an exercise is the score of its independent answer against the
official solution (the higher of the two directions): how alike two honest answers are. Where it is high (an exercise
whose rules leave one way to write it), the exercise flags only above the floor + `MARGIN`; at a floor of 0.9 or
more it cannot flag at all, and the report says so.

No learner code runs here: the text is only tokenized, in the grader's process.
"""

from __future__ import annotations

import ast
import difflib
import functools
import html
import io
import json
import tokenize
from pathlib import Path

from course_lib import notebook as nbio
from course_lib.grading import authoring, build

K = 20             # characters of filtered code per fingerprinted k-gram (about one statement: ``V=V.V(V,V=V)``)
WINDOW = 1         # every k-gram is kept: scores do not depend on the (per-process salted) string hashes
MARGIN = 0.1       # an exercise flags at max(threshold, its noise floor + MARGIN): honest pairs stay below
MIN_CHARS = 40     # shorter answers (filtered) are not scored: too little code to tell a copy from agreement
DEFAULT_THRESHOLD = 0.8
MAX_CHARS = 200_000  # an answer is cut here (a pasted megabyte must not stall the class's report)
SOLUTION = "official solution"
ROOT = Path(__file__).resolve().parents[2]


class SimilarityError(ValueError):
    """The answers cannot be compared (no solution of their lesson): the message says what to give."""


# ------------------------------------------------------------------------------- what the learner wrote

def _text_rows(src: str) -> set[int]:
    """Rows (from 1) of ``src`` that hold only a string statement or part of a string over several lines (a
    docstring): text, not code, and a fragment of it would make the tokenizer read the code after it as a string."""
    rows: set[int] = set()
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return rows                            # not Python as a whole (a magic): its lines are kept as they are
    code_rows = {r for t in tokens if t.type not in (tokenize.STRING, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT,
                                                     tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
                 for r in range(t.start[0], t.end[0] + 1)}
    for t in tokens:
        if t.type == tokenize.STRING:
            rows |= {r for r in range(t.start[0], t.end[0] + 1) if r not in code_rows or t.end[0] > t.start[0]}
    return rows


def _code_lines(cells: list[str]) -> list[str]:
    """The non-blank lines of ``cells`` that are code (docstrings and string statements left out)."""
    out = []
    for src in cells:
        text = _text_rows(src)
        out += [line.rstrip() for n, line in enumerate(src.split("\n"), 1) if line.strip() and n not in text]
    return out


def _spans(nb) -> dict[str, list[str]]:
    """{coding exercise: sources of its code cells that are not tests}."""
    cells = nb["cells"]
    return {ex: [nbio.source(cells[i]) for i in idx if not authoring.is_test(cells[i])]
            for ex, idx in build._exercise_cells(nb).items() if not ex.endswith("-quiz")}


@functools.lru_cache(maxsize=65536)
def _filtered(line: str) -> str:
    """A line as the fingerprints see it: names ``V``, strings ``S``, no comments or spaces."""
    from copydetect.utils import filter_code

    return filter_code(line.strip(), "line.py", "python")[0].strip()


def added_lines(template: list[str], written: list[str]) -> str:
    """The lines of ``written`` that are not ``template``'s (inserted or changed), in order. Lines are compared as
    the fingerprints see them (`_filtered`), so that a given line with its names changed is still the given line."""
    matcher = difflib.SequenceMatcher(None, [_filtered(t) for t in template], [_filtered(w) for w in written],
                                      autojunk=False)
    out = [written[j] for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert")
           for j in range(j1, j2)]
    return "\n".join(line for line in out if "raise NotImplementedError(" not in line)[:MAX_CHARS]


@functools.lru_cache(maxsize=64)
def _template(official_json: str, lesson: str) -> dict[str, list[str]]:
    return {ex: _code_lines(srcs) for ex, srcs in _spans(build.make_exercise(json.loads(official_json),
                                                                            lesson)).items()}


def learner_code(assembled, official, lesson: str) -> dict[str, str]:
    """{coding exercise: the code the learner wrote for it} of an assembled submission (`grade.assemble`)."""
    template = _template(json.dumps(official, sort_keys=True), lesson)
    return {ex: added_lines(template.get(ex, []), _code_lines(srcs)) for ex, srcs in _spans(assembled).items()}


# ------------------------------------------------------------------------------------------ the sources

def solution_answers(official) -> dict[str, str]:
    """{coding exercise: the official solution's answer regions (the lines between the markers)}."""
    out = {}
    for ex, srcs in _spans(official).items():
        lines, inside = [], False
        for line in _code_lines(srcs):
            if line.strip().startswith(authoring.BEGIN):
                inside = True
            elif line.strip().startswith(authoring.END):
                inside = False
            elif inside and not authoring.HINT_RE.match(line):
                lines.append(line)
        out[ex] = "\n".join(lines)
    return out


@functools.lru_cache(maxsize=4)
def marked_sources(package: Path = ROOT / "course_lib") -> dict[str, dict[str, str]]:
    """{exercise: {dotted name: source}} of every ``@reference_for(...)`` in ``package``, read with `ast` (nothing is
    imported)."""
    found: dict[str, dict[str, str]] = {}
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        if "@reference_for(" not in text:
            continue
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for node, prefix in _defs(ast.parse(text), module):
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "reference_for":
                    for arg in deco.args:
                        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                            found.setdefault(arg.value, {})[f"{prefix}.{node.name}"] = ast.get_source_segment(text,
                                                                                                           node)
    return found


def _defs(tree, prefix: str):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node, prefix
            if isinstance(node, ast.ClassDef):
                yield from _defs(node, f"{prefix}.{node.name}")


def independent_answers(solutions_folder: Path, lesson: str, official) -> dict[str, str]:
    """{exercise: the learner-written part of the independent answer} from ``solutions/independent/lNN.py``
    (``ANSWERS``, read with `ast.literal_eval`; {} where there is none)."""
    path = Path(solutions_folder) / "independent" / f"l{lesson[:2]}.py"
    if not path.exists():
        return {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ANSWERS":
            answers = ast.literal_eval(node.value)
            break
    else:
        return {}
    template = _template(json.dumps(official, sort_keys=True), lesson)
    return {ex: added_lines(template.get(ex, []), _code_lines([code])) for ex, code in answers.items()}


# ------------------------------------------------------------------------------------------ comparing

class _Print:
    """One text's fingerprints (`copydetect.CodeFingerprint`, Python's tokens)."""

    def __init__(self, code: str):
        from copydetect import CodeFingerprint

        self.code = code
        self.fp = CodeFingerprint("answer.py", K, WINDOW, filter=True, language="python", fp=io.StringIO(code))
        self.size = len(self.fp.filtered_code)


def score(a: _Print, b: _Print) -> tuple[float, tuple]:
    """The share of ``a``'s filtered code that ``b`` also holds (0 to 1), and the copied slices of (a, b)."""
    from copydetect import compare_files

    if a.size < MIN_CHARS or b.size == 0 or a.fp.hashes.isdisjoint(b.fp.hashes):
        return 0.0, ()
    _, (sim_a, _), slices = compare_files(a.fp, b.fp)
    return round(min(1.0, float(sim_a)), 3), slices


def class_report(results: list[dict], solutions, threshold: float = DEFAULT_THRESHOLD) -> dict:
    """The similarity of every graded submission of ``results`` (they carry ``answers``: `learner_code`), per
    exercise: its most similar source and score, flagged at ``threshold`` or above; each exercise's noise floor.
    Adds ``similarity`` ({exercise: {source, score, flagged}}) to each result; returns the report (JSON-ready)."""
    graded = [r for r in results if r.get("status") == "graded" and r.get("answers")]
    report = {"threshold": threshold, "k": K, "window": WINDOW, "min_chars": MIN_CHARS, "exercises": {}}
    if not graded:
        return report
    lesson = graded[0]["lesson"]
    if lesson not in solutions.notebooks:
        raise SimilarityError(f"no solution of lesson {lesson} in {solutions.folder} to compare the answers with")
    official = solutions.notebooks[lesson]
    sources = {ex: {SOLUTION: code} for ex, code in solution_answers(official).items()}
    independent = independent_answers(solutions.folder, lesson, official)
    for ex in sources:
        sources[ex].update(marked_sources().get(ex, {}))
        if ex in independent:
            sources[ex][f"independent answer (solutions/independent/l{lesson[:2]}.py)"] = independent[ex]
    for ex, refs in sources.items():
        if not refs[SOLUTION].strip():
            continue                     # its answer is written in an earlier exercise's cells, compared there
        prints = {name: _Print(code) for name, code in refs.items()}
        mine = {r.get("student", r["submission"]): _Print(r["answers"].get(ex, "")) for r in graded}
        floor = None
        if ex in independent:
            own = _Print(independent[ex])
            floor = max(score(own, prints[SOLUTION])[0], score(prints[SOLUTION], own)[0])
        flag_at = max(threshold, (floor or 0.0) + MARGIN)
        rows, pairs = [], []
        for student, p in mine.items():
            others = {**prints, **{f"classmate {s}": q for s, q in mine.items() if s != student}}
            best_name, best, best_slices, matches = None, 0.0, (), []
            for name, q in others.items():
                s, slices = score(p, q)
                if s > best:
                    best_name, best, best_slices = name, s, slices
                if s >= flag_at and p.size >= MIN_CHARS:
                    matches.append((name, s))
            row = {"student": student, "chars": p.size, "source": best_name, "score": best,
                   "scored": p.size >= MIN_CHARS, "flagged": p.size >= MIN_CHARS and best >= flag_at,
                   "matches": sorted(matches, key=lambda m: -m[1])[:5]}
            rows.append(row)
            shown = [name for name, _ in row["matches"][:3]] or ([best_name] if best >= 0.5 else [])
            for name in shown:                              # side by side in the HTML: the flags, or a near miss
                s, slices = (best, best_slices) if name == best_name else score(p, others[name])
                pairs.append((student, name, p, others[name], slices, s))
        report["exercises"][ex] = {"noise_floor": floor, "flag_at": round(flag_at, 3), "rows": rows,
                                   "_pairs": pairs}
        for r, row in zip(graded, rows):
            r.setdefault("similarity", {})[ex] = {k: row[k] for k in ("source", "score", "flagged", "scored", "matches")}
    return report


def to_json(report: dict) -> dict:
    """The report without the side-by-side texts (what ``similarity.json`` holds)."""
    return {**report, "exercises": {ex: {k: v for k, v in e.items() if not k.startswith("_")}
                                    for ex, e in report["exercises"].items()}}


def table(report: dict) -> str:
    """Per exercise: each submission's most similar source and score, flags marked."""
    lines = [f"== similarity (share of each answer's code found in its most similar source; flagged at "
             f">= {report['threshold']:g}, or the exercise's noise floor + {MARGIN:g} where higher; answers under "
             f"{MIN_CHARS} characters of code are not scored)"]
    for ex, e in report["exercises"].items():
        lines.append(f"   {ex}  ({_floor_words(e)})")
        for row in e["rows"]:
            what = (f"{row['score']:.2f}  {row['source'] or '-'}" if row["scored"]
                    else f"  -   too short to compare ({row['chars']} characters of code)")
            also = ", ".join(f"{name} {s:.2f}" for name, s in row["matches"][1:3])
            lines.append(f"     {row['student']:<20} {what}{'  FLAGGED' if row['flagged'] else ''}"
                         + (f" (also {also})" if also else ""))
    return "\n".join(lines)


def _floor_words(e: dict) -> str:
    if e["noise_floor"] is None:
        return "noise floor unknown: no independent answer on record"
    words = f"noise floor {e['noise_floor']:.2f}: two honest answers share that much"
    return words + (f"; flagged at {e['flag_at']:.2f}" if e["flag_at"] <= 1 else
                    "; this exercise cannot tell a copy from an honest answer: never flagged")


def csv_cells(result: dict) -> tuple[str, str]:
    """The class CSV's two columns: the highest score, and each flagged exercise with its sources at or above the
    flag (up to three, most similar first)."""
    sim = result.get("similarity") or {}
    scored = [v["score"] for v in sim.values() if v["scored"]]
    flags = "; ".join(f"{ex}: " + ", ".join(f"{name} {s:.2f}" for name, s in v["matches"][:3])
                      for ex, v in sim.items() if v["flagged"])
    return (f"{max(scored):.2f}" if scored else ""), flags


def _highlighted(p: _Print, slices, cls: str) -> str:
    from copydetect.utils import highlight_overlap

    if len(slices) == 0 or len(slices[0]) == 0:
        return html.escape(p.code)
    return highlight_overlap(p.code, slices, f"<mark class='{cls}'>", "</mark>", escape_html=True)[0]


STYLE = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
         "padding:2px 8px}.pair{display:flex;gap:1em}.pair>div{flex:1;min-width:0}pre{background:#f6f6f6;"
         "padding:.5em;overflow:auto}mark.a{background:#fbb}mark.b{background:#bfb}.flag{color:#b00;"
         "font-weight:bold}")


def write_html(report: dict, path: str | Path) -> None:
    """One page, no network: per exercise the table and, for each flagged answer (or any at 0.5 or above), the
    two answers side by side with the shared code marked (copydetect's `highlight_overlap`)."""
    out = [f"<!doctype html><meta charset='utf-8'><title>Similarity</title><style>{STYLE}</style>",
           f"<h1>Similarity of answers</h1><p>{html.escape(table(report).splitlines()[0][3:])}. "
           f"Fingerprints: copydetect (winnowing), k = {K} characters of filtered code, window {WINDOW}. A flag is "
           f"for you to judge: it changes no points.</p>"]
    for ex, e in report["exercises"].items():
        out.append(f"<h2 id='{html.escape(ex)}'>{html.escape(ex)}</h2><p>{html.escape(_floor_words(e))} (the "
                   f"independent answer against the official solution)</p><table><tr><th>student</th><th>most similar "
                   f"source</th><th>score</th><th></th></tr>")
        for row in e["rows"]:
            shown = f"{row['score']:.2f}" if row["scored"] else f"not scored ({row['chars']} characters)"
            out.append(f"<tr><td>{html.escape(row['student'])}</td><td>{html.escape(row['source'] or '-')}</td>"
                       f"<td>{shown}</td><td class='flag'>{'flagged' if row['flagged'] else ''}</td></tr>")
        out.append("</table>")
        for student, source, a, b, slices, s in e.get("_pairs", []):
            left = _highlighted(a, slices[0] if slices else (), "a")
            right = _highlighted(b, slices[1] if slices else (), "b")
            out.append(f"<h3>{html.escape(student)} vs {html.escape(source)}: {s:.2f}</h3><div class='pair'>"
                       f"<div><b>{html.escape(student)}</b><pre>{left}</pre></div>"
                       f"<div><b>{html.escape(source)}</b><pre>{right}</pre></div></div>")
    Path(path).write_text("\n".join(out) + "\n")


def write(report: dict, folder: str | Path) -> list[Path]:
    """``folder/similarity.html`` and ``folder/similarity.json``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_html(report, folder / "similarity.html")
    (folder / "similarity.json").write_text(json.dumps(to_json(report), indent=1) + "\n")
    return [folder / "similarity.html", folder / "similarity.json"]

