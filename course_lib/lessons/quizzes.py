"""The self-check quizzes of the lesson notebooks, checked against salted digests: the notebook never spells an answer.

    q1 = None   # your answer
    quiz("03", {"q1": q1, "q2": q2, "q3": q3})      # prints right / not yet (with a pointer) / not answered yet

Digests come from ``course_lib.grading.check.answer_digest(f"lesson {lesson} quiz {q}", expected, rtol)``;
tests/test_quizzes.py computes every expected value from the course's formulas and checks the digests (the
answers live there, not in the notebooks). Graded quizzes (``exercises/``) use ``check_answer`` the same way.
"""

from __future__ import annotations

from course_lib.grading.check import CheckFailed, check_answer

__all__ = ["QUIZZES", "quiz", "score"]

# lesson -> question -> (digest, rtol or None for an exact answer, where to look when it is not right)
QUIZZES: dict[str, dict[str, tuple[str, float | None, str]]] = {
    "00": {
        "q1": ("fbe4d30ce88d5ddc980977fa", None, "section 3: a sum over every rank's value"),
        "q2": ("6f8e698bef48ef074250d0f4", None, "section 3: all_gather concatenates one tensor per rank"),
        "q3": ("e72aee0cc331979ef46b4155", None, "section 3: what broadcast writes on the other ranks"),
    },
    "01": {
        "q1": ("2c82bb3b2288f233901935ec", 0.02, "section 1.1: 6N plus the attention term"),
        "q2": ("561bd39045f34bf9bca83537", 0.02, "section 2.1: bytes per parameter of mixed-precision Adam"),
        "q3": ("aa1ee8bc5dba0c425d9a4393", 0.02, "section 3: algorithm bandwidth times the bus factor of all_reduce"),
    },
    "02": {
        "q1": ("0e3cd1b8de8cd2b71198c216", 0.001, "section 2: the ring all-reduce's bytes per rank"),
        "q2": ("00cfaaf96aea25e563d956cb", 0.001, "section 2: bytes per rank times the number of ranks"),
        "q3": ("f213efa0d27f84c974e4ace7", None, "section 4: no_sync skips the all-reduce of all but one micro-batch"),
        "q4": ("f89ece4fc29ce47153584960", 0.001, "section 6: the scaling efficiency's definition"),
    },
    "03": {
        "q1": ("cae43f5380fd0edd755638c8", 0.001, "section 5: the bubble fraction of GPipe"),
        "q2": ("e173730504fdbed23c9fc0dc", None, "section 6: how many micro-batches 1F1B keeps in flight on each rank"),
        "q3": ("c306118b3593f3876bc28b96", None, "section 9: the bubble with interleaving and with more micro-batches"),
        "q4": ("d12fcdff176e428aa9d55518", 0.001, "sections 3 and 10: a 1F1B step's length, and a ZB-V step's with "
                                                  "chunks of half a stage"),
    },
    "04": {
        "q1": ("a174a9fa1a581c5bf261558c", None, "section 1: f and g, per attention and per MLP, forward and backward"),
        "q2": ("09165646cbac3849e89ff188", 0.02, "section 2: one (B, T, C) activation in bf16"),
        "q3": ("be257604b10fd3458bed66ad", 0.02, "section 4: sequence parallelism splits every activation"),
    },
    "05": {
        "q1": ("69fcb9060218b015454d196e", 0.01, "section 1: the ZeRO-1 row of the table"),
        "q2": ("33fa56850772916b0de7ce0b", 0.01, "section 1: the ZeRO-3 row of the table"),
        "q3": ("4288ece98ad5c0ed6129e60f", 0.01, "section 3: reduce-scatter plus all-gather against an all-reduce"),
    },
    "06": {
        "q1": ("f7500c2b21e5659a1a796308", 1e-06, "section 1: the largest exponent and mantissa of fp16"),
        "q2": ("67a50bd92e795b7aca1452ef", 1e-06, "section 4: one back-off per overflow, a growth after the interval"),
        "q3": ("07ea1b52a00306972430eb6a", None, "section 4: weights, gradients, master weights and two moments"),
    },
    "07": {
        "q1": ("628ddcad8263b03e894162f7", 0.01, "section 4: the softmax output is (B, H, T, T)"),
        "q2": ("85d5110fc46546c56501ca2b", None, "section 2.2: the sqrt rule and the integer next to it"),
        "q3": ("30ec11f1bc48e6a914a11718", 0.01, "section 2.1: forward 1 unit, backward 2, recomputation"),
    },
    "08": {
        "q1": ("08c5ef557325204fad5cbb35", None, "section 1: a PP group keeps dp and tp, and takes every pp"),
        "q2": ("68faa19ba2715ce61ea3717b", 0.01, "section 3: the planner's bubble, of the compute and of the step"),
        "q3": ("358257b6ae408c0487d73b1a", 0.02, "section 3: divide by tp x pp, then ZeRO-1's row of lesson 05"),
    },
    "09": {
        "q1": ("1d12243f4b588296d24965d0", 0.01, "section 1: where s stands in the cosine, after the warm-up"),
        "q2": ("2f1e96df65472ce0172d321c", 0.02, "section 5.2: the job's MTBF first, then Young's interval"),
        "q3": ("c56eed5b7724ce735e65923b", 0.01, "section 2: the norm the bug computes, then the clipping rule there"),
        "q4": ("443301895d0d506f66209c24", 0.01, "section 7.1: the z-score's formula, with the window written out"),
        "q5": ("f7b710efd458a5454f2ba4a5", 0.01, "section 7.4: weigh each micro-batch by its valid tokens"),
    },
    "10": {
        "q1": ("3a260455ceb6fe058b23ad8a", 0.01, "section 4: what one rank sends in the ring's forward, and how many times"),
        "q2": ("922458c31577bd43acd66d0d", 0.001, "section 3: each step lasts as long as its slowest rank; the causal "
               "flash kernel's convention"),
        "q3": ("423687081bf0b29c94348f45", None, "section 4: Ulysses gives each rank whole heads, K/V heads included"),
        "q4": ("2c20ec375a325ec160fb944e", 0.01, "section 7: which tokens each rank's queries are under the head-tail "
               "split, and how many keys a token sees inside its document"),
        "q5": ("11bdde3a918c6d4f3d6a5502", 0.01, "section 8: what the all-to-all puts on the wire inside the group, "
               "and what the ring sends across"),
    },
    "11": {
        "q1": ("bcce44ab22ec12b903d7ba67", 0.01, "section 3: what one dispatch carries, counted row by row"),
        "q2": ("d856e54b41f67d43897667ba", None,
               "section 2, capacity: a limit on each expert's queue, or a budget the experts share?"),
        "q3": ("585ba3c09d47d606dd065aa4", 0.02, "section 1: which experts' weights one token's matmuls never touch"),
        "q4": ("2bec433fc932089c5f26ee1a", 0.01, "section 8: what sets the step when one rank's experts get more rows"),
        "q5": ("3d9d03d0202eeeb94a2a690a", None, "section 11: the number of ways to choose k of E experts"),
    },
    "12": {
        "q1": ("03f22eddf322a0706b63851e", 0.02, "section 4: the scale maps the amax onto e4m3's largest value"),
        "q2": ("657390779592a6220132dd1c", 0.02, "section 3: the head's FLOPs grow with the rows added, not the total"),
        "q3": ("e2a20fe98f3dff32b8b39c79", None, "section 3: tiles along each side, then whole waves of 132"),
    },
}


def score(lesson: str, answers: dict, run: dict | None = None) -> dict[str, str]:
    """{question: "right" | "not yet (where to look)" | "not answered yet"} for ``answers``.

    ``run``: questions whose answer depends on this run's measurement, ``{q: expected}`` (compared, not hashed)."""
    if lesson not in QUIZZES:
        raise KeyError(f"no quiz for lesson {lesson!r}: lessons {', '.join(QUIZZES)}")
    out = {}
    for q, answer in answers.items():
        if answer is None:
            out[q] = "not answered yet"
        elif run and q in run:
            out[q] = "right" if answer == run[q] else "not yet (compare with your own measurement above)"
        elif q not in QUIZZES[lesson]:
            raise KeyError(f"lesson {lesson} has no quiz question {q!r}: {', '.join(QUIZZES[lesson])}")
        else:
            digest, rtol, where = QUIZZES[lesson][q]
            try:
                check_answer(f"lesson {lesson} quiz {q}", answer, digest, rtol=rtol)
                out[q] = "right"
            except CheckFailed:
                out[q] = f"not yet ({where})"
    return out


def quiz(lesson: str, answers: dict, run: dict | None = None) -> None:
    """Print, per question, whether the answer is right, not yet (and where to look), or not answered yet; never
    raises on a wrong or missing answer, so that a lesson runs top to bottom with empty answers."""
    result = score(lesson, answers, run)
    for q, verdict in result.items():
        print(f"{q}: {verdict}")
    print(f"{sum(v == 'right' for v in result.values())} of {len(result)} right")
