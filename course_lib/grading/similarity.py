"""Copied answers: which answers of a class are near-copies of the course's own code or of a classmate's.

``course grade`` (docs/GRADING.md, "Copied answers") compares the code each learner wrote for an exercise with
- the course's answers to every exercise of the lesson: the official solution's answer regions
  (``solutions/NN_*.ipynb``), the implementations marked ``@reference_for(exercise)`` (their source, found without
  importing them) and the independently written answer of ``solutions/independent/lNN.py``;
- every other submission's code for the same exercise.

*The code a learner wrote* (`learner_code`): the submission's code cells of the exercise (those after the previous
exercise's test cells, as the grader assembles them), minus the lines of the student copy's same cells (the given
code: signatures, set-up, stubs), found with `difflib`; docstrings are text and left out (`_clean`). The fingerprints
are `copydetect`'s: Pygments tokens, variable and attribute names ``V``, defined function and class names ``F`` and
``O``, string contents ``S``, comments and whitespace gone; every k-gram of `K` characters kept (`WINDOW` 1). So
renamed variables, added comments, changed layout and reordered statements leave a copy's fingerprints in place.

The *score* of an answer against a source (`score`) is the larger of the share of the answer's filtered code that
the source holds and the share of the source's that the answer holds, 0 to 1: the most similar source is reported,
and the sources at or above the flag (`flag_at`) are *matches*, which flag the answer for the instructor to judge; a
flag never changes points. An answer shorter than `MIN_CHARS` filtered characters is not scored (two honest
one-liners look alike). The *noise floor* of an exercise is the score of its independent answer against the official
solution: how alike two honest answers are. An exercise's sources flag at the threshold or at its floor + `MARGIN`,
whichever is higher; at 1 or more (a floor of 0.9 or more) it cannot flag at all, and the report says so.

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

_LAYOUT = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)


def _tokenizes(line: str) -> bool:
    try:
        list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
        return True
    except (tokenize.TokenError, SyntaxError):
        return False


def _clean(src: str) -> list[str]:
    """The code lines of one cell: a string over several lines becomes ``""`` (so that no line of the answer holds a
    piece of a string, which would make the tokenizer read the code after it as a string), a line that is only a
    string (a docstring) goes, blank lines go. A cell that is not Python as a whole (a magic, a stray quote) keeps
    the lines that tokenize on their own."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (tokenize.TokenError, SyntaxError):
        return [line.rstrip() for line in src[:MAX_CHARS].split("\n") if line.strip() and _tokenizes(line)]
    lines = src.split("\n")
    code_rows = {r for t in tokens if t.type not in (tokenize.STRING, *_LAYOUT) for r in range(t.start[0], t.end[0] + 1)}
    text_rows: set[int] = set()
    for t in reversed(tokens):                       # right to left: the positions of earlier tokens stay valid
        if t.type != tokenize.STRING:
            continue
        (r0, c0), (r1, c1) = t.start, t.end
        if not code_rows & set(range(r0, r1 + 1)):
            text_rows |= set(range(r0, r1 + 1))      # a string statement: text
        elif r1 > r0:
            lines[r0 - 1: r1] = [lines[r0 - 1][:c0] + '""' + lines[r1 - 1][c1:]] + [None] * (r1 - r0)
    return [line.rstrip() for n, line in enumerate(lines, 1)
            if line is not None and line.strip() and n not in text_rows]


def _code_lines(cells: list[str]) -> list[str]:
    """The code lines of ``cells`` (`_clean`), each cell cut at `MAX_CHARS`."""
    return [line for src in cells for line in _clean(src[:MAX_CHARS])]


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
    template = [t for t in template if _filtered(t)]             # comment-only lines: nothing to match
    written = [w for w in written if _filtered(w)]
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
        lines = authoring.answer_lines(_code_lines(srcs))
        out[ex] = "\n".join(line for line in lines if not authoring.HINT_RE.match(line))
    return out


@functools.lru_cache(maxsize=4)
def marked_sources(package: Path = ROOT / "course_lib") -> dict[str, dict[str, str]]:
    """{exercise: {dotted name: source}} of every ``@reference_for(...)`` in ``package``, read with `ast` (nothing is
    imported)."""
    found: dict[str, dict[str, str]] = {}
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
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


def read_answers(path: Path) -> dict[str, str]:
    """``ANSWERS`` ({exercise: answer cell}) of an answers file (``solutions/independent/lNN.py``), read with
    `ast.literal_eval`: nothing in it runs; {} where it assigns none."""
    for node in ast.parse(Path(path).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ANSWERS":
            return ast.literal_eval(node.value)
    return {}


def independent_answers(solutions_folder: Path, lesson: str, official) -> dict[str, str]:
    """{exercise: the learner-written part of the independent answer} from ``solutions/independent/lNN.py``
    (``ANSWERS``, read with `ast.literal_eval`; {} where there is none)."""
    path = Path(solutions_folder) / "independent" / f"l{lesson[:2]}.py"
    answers = read_answers(path) if path.exists() else {}
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
    """How much of ``a`` and ``b`` is shared, 0 to 1: the larger of the share of ``a``'s filtered code that ``b``
    holds and the share of ``b``'s that ``a`` holds (so that padding a copy with other code does not hide it); a
    text under `MIN_CHARS` counts on neither side. Returns the score and the shared slices of (a, b)."""
    from copydetect import compare_files

    if a.size < MIN_CHARS or b.size == 0 or a.fp.hashes.isdisjoint(b.fp.hashes):
        return 0.0, ()
    _, (sim_a, sim_b), slices = compare_files(a.fp, b.fp)
    shared = max(float(sim_a), float(sim_b) if b.size >= MIN_CHARS else 0.0)
    return round(min(1.0, shared), 3), slices


def flag_at(threshold: float, floor: float | None) -> float:
    """The score at which an exercise flags: the threshold, or its noise floor + `MARGIN` where higher (1 or more:
    it never flags)."""
    return round(max(threshold, (floor or 0.0) + MARGIN), 3)


def _sources(solutions, lesson: str) -> tuple[dict, dict]:
    """({exercise: {source name: text}}, {exercise: noise floor}) of the course's side of ``lesson``."""
    if lesson not in solutions.notebooks:
        raise SimilarityError(f"no solution of lesson {lesson} in {solutions.folder} to compare the answers with")
    official = solutions.notebooks[lesson]
    independent = independent_answers(solutions.folder, lesson, official)
    sources, floors = {}, {}
    for ex, code in solution_answers(official).items():
        if not code.strip():
            continue                     # its answer is written in an earlier exercise's cells, compared there
        sources[ex] = {SOLUTION: code, **marked_sources().get(ex, {})}
        if ex in independent:
            sources[ex][f"independent answer (solutions/independent/l{lesson[:2]}.py)"] = independent[ex]
            own, sol = _Print(independent[ex]), _Print(code)
            floors[ex] = max(score(own, sol)[0], score(sol, own)[0])
    return sources, floors


def class_report(results: list[dict], solutions, threshold: float = DEFAULT_THRESHOLD) -> dict:
    """The similarity of every graded submission of ``results`` (they carry ``answers``: `learner_code`), per
    exercise: its most similar source and score, and the sources at or above the flag (`flag_at`). An answer is
    compared with the course's answers to every exercise of the lesson (a copy pasted in another exercise's cell
    is found), and with the classmates' answers to the same exercise. Adds ``similarity`` ({exercise: {source,
    score, flagged, scored, matches}}) to each result; returns the report (JSON-ready but for ``_pairs``)."""
    graded = [r for r in results if r.get("status") == "graded" and r.get("answers")]
    report = {"threshold": threshold, "k": K, "window": WINDOW, "min_chars": MIN_CHARS, "exercises": {}}
    if not graded:
        return report
    lessons = {r["lesson"] for r in graded}
    if len(lessons) > 1:
        raise SimilarityError(f"one lesson at a time: these answers are of {', '.join(sorted(lessons))}")
    lesson = lessons.pop()
    sources, floors = _sources(solutions, lesson)
    course = [(name, ex, _Print(code)) for ex, refs in sources.items() for name, code in refs.items()]
    who = [r.get("student", r["submission"]) for r in graded]
    for ex in sources:
        mine = [_Print(r["answers"].get(ex, "")) for r in graded]
        rows, pairs = [], []
        for i, p in enumerate(mine):
            others = [(name if src_ex == ex else f"{name} (the answer to {src_ex})", src_ex, q)
                      for name, src_ex, q in course]
            others += [(f"classmate {who[j]}", ex, q) for j, q in enumerate(mine) if j != i]
            best, best_name, matches, found = 0.0, None, [], {}
            for name, src_ex, q in others:
                s, slices = score(p, q)
                found[name] = (q, slices, s)
                if s > best:
                    best, best_name = s, name
                at = flag_at(threshold, floors.get(src_ex))
                if p.size >= MIN_CHARS and at < 1.0 and s >= at:
                    matches.append((name, s))
            matches.sort(key=lambda m: -m[1])
            row = {"student": who[i], "chars": p.size, "source": best_name, "score": best,
                   "scored": p.size >= MIN_CHARS, "flagged": bool(matches), "matches": matches[:5]}
            rows.append(row)
            for name in [m[0] for m in matches[:3]] or ([best_name] if best >= 0.5 else []):
                q, slices, s = found[name]              # side by side in the HTML: the flags, or a near miss
                pairs.append((who[i], name, p, q, slices, s))
            graded[i].setdefault("similarity", {})[ex] = {k: row[k] for k in
                                                          ("source", "score", "flagged", "scored", "matches")}
        report["exercises"][ex] = {"noise_floor": floors.get(ex), "flag_at": flag_at(threshold, floors.get(ex)),
                                   "rows": rows, "_pairs": pairs}
    return report


def to_json(report: dict) -> dict:
    """The report without the side-by-side texts (what ``similarity.json`` holds)."""
    return {**report, "exercises": {ex: {k: v for k, v in e.items() if not k.startswith("_")}
                                    for ex, e in report["exercises"].items()}}


def table(report: dict) -> str:
    """Per exercise: each submission's most similar source and score, flags marked."""
    lines = [f"== similarity (how much each answer shares with its most similar source, 0 to 1; flagged at "
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
    return words + (f"; flagged at {e['flag_at']:.2f}" if e["flag_at"] < 1 else
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
    Path(path).write_text("\n".join(out) + "\n", encoding="utf-8")


def write(report: dict, folder: str | Path) -> list[Path]:
    """``folder/similarity.html`` and ``folder/similarity.json``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_html(report, folder / "similarity.html")
    (folder / "similarity.json").write_text(json.dumps(to_json(report), indent=1) + "\n", encoding="utf-8")
    return [folder / "similarity.html", folder / "similarity.json"]

