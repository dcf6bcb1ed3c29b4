"""Quizzes: every answer is checked against a salted digest; the learner's notebooks and exercises never spell it.

The expected values live here, computed from the course's formulas (the lessons' quiz cells hold only digests).
"""

from __future__ import annotations

import io
import json
import math
import re
import tokenize
from pathlib import Path

import pytest
import torch

from course_lib import theory
from course_lib.config import get_preset
from course_lib.dist import GridLayout
from course_lib.grading.check import CheckFailed, answer_digest, check_answer
from course_lib.lessons.l11_experts.experiments import mixtral_config
from course_lib.lessons.quizzes import QUIZZES, quiz, score
from course_lib.measure.hardware import GPU_SPECS
from course_lib.parallel import moe, schedules
from course_lib.parallel.context_documents import document_work_per_rank
from course_lib.theory import practice

ROOT = Path(__file__).resolve().parents[1]

EXPECTED = {
    "00": {"q1": sum(r * r for r in range(4)), "q2": 4 * 3, "q3": False},
    "01": {"q1": theory.flops.flops_per_token(get_preset("gpt2-124m")) / 1e9,
           "q2": theory.memory.mixed_precision_bytes(get_preset("llama-7b").num_params())["total"] / 1e9,
           "q3": theory.comm.bus_bandwidth("all_reduce", 1e9, 0.05, 8) / 1e9},
    "02": {"q1": 2 * 7 / 8 * 400, "q2": 2 * 4 * 10, "q3": 6, "q4": 3400 / (4 * 1000) * 100},
    "03": {"q1": theory.pipeline.bubble_fraction(8, 24),
           "q2": theory.pipeline.peak_microbatches_in_flight("1f1b", 8, 24, rank=2), "q3": "same",
           # p = 8, m = 16, a stage's F, B, W 2 ms each: 1F1B (m + p - 1)(t_F + t_B + t_W); ZB-V 2 m 3 t + (p - 1) t
           # with a chunk's t = 1 ms
           "q4": theory.pipeline.step_time(8, 16, 2.0, 4.0)
           - (6 * 16 * 1.0 + theory.pipeline.v_shape_idle_time("zb-v", 8, 16, 1.0))},
    "04": {"q1": 4, "q2": 1 * 2048 * 12288 * 2 / 1e6, "q3": 1 / 8},
    "05": {"q1": theory.memory.zero_model_state_bytes(13e9, 16, 1)["total"] / 1e9,
           "q2": theory.memory.zero_model_state_bytes(13e9, 16, 3)["total"] / 1e9,
           "q3": theory.memory.zero_comm_bytes(1, 16, 2)["vs_ddp"]},
    "06": {"q1": torch.finfo(torch.float16).max, "q2": 2.0 ** 16 * 0.5 ** 3 * 2, "q3": 2 + 2 + 4 + 4 + 4},
    "07": {"q1": 32 * 8192 ** 2 * 2 / 1e9, "q2": theory.savers.best_checkpoint_every(64, 16.0, 1.0)["every"],
           "q3": theory.savers.recompute_flops_ratio(1.0)},
    "08": {"q1": max(GridLayout(dp=4, pp=2, tp=8).members(21, "pp")),
           "q2": theory.pipeline.bubble_fraction(12, 1536 // (16 * 1)),                # dp 16, micro-batch 1
           "q3": (2 + 2 + 12 / 12) * 175e9 / (8 * 16) / 1e9},
    "09": {"q1": schedules.warmup_cosine(301_000, peak_lr=6e-4, warmup_steps=2000, total_steps=600_000, min_lr=6e-5),
           "q2": practice.young_daly_interval(120, practice.job_mtbf(50_000 * 3600, 16384)) / 60,
           "q3": min(1.0, 1.0 / (0.5 * math.sqrt(8) + 1e-6)),      # max_norm / the norm summed over 8 replicas
           "q4": (3.5 - 3.45) / (0.1 * math.sqrt(10 * 11 / 12)),     # a falling line's own spread: z of 3.50
           "q5": (2 * 100 + 3 * 300 + 2 * 200 + 3 * 400) / 1000 - (2 + 3 + 2 + 3) / 4},   # tokens vs micro-batches
    "10": {"q1": theory.context.layer_comm("ring", 1, 131072, 4096, 8, 2)[("forward", "send")]["bytes"] / 1e9,
           "q2": theory.context.ring_critical_path(4096, 8, "contiguous", "half")
           / theory.context.ring_critical_path(4096, 8, "balanced", "half"), "q3": 8,    # 8 K/V heads of Llama-3-8B
           "q4": (lambda w: max(w) / min(w))(document_work_per_rank([1024, 3072, 4096], 2, "head_tail")),
           "q5": sum(theory.context_hybrid.hybrid_bytes_sent_per_rank(1, 131072, 4096, 8, 2, 2, "forward").values())
           / 1e9},
    "11": {"q1": theory.experts.uniform_layer_comm(4096, 8, 7168, 8, dtype_bytes=2)["payload"] / 1e6,
           "q2": sum(max(0, n - moe.capacity_of(1.0, 1024, 1, 4)) for n in (400, 208, 208, 208)),   # no rerouting:
           # the 3 x 48 free places of the other experts do not take expert 0's 144 extra tokens
           "q3": 100 * (lambda p: p["active"] / p["total"])(theory.experts.moe_params(mixtral_config(), 8, 1)),
           "q4": theory.moe_imbalance.straggler_step_time(theory.moe_imbalance.skewed_loads(16384, 0.9, 2), 1.0)[
               "ratio"],
           "q5": theory.experts_fine.routing_combinations(32, 8)},
    "12": {"q1": torch.finfo(torch.float8_e4m3fn).smallest_normal * 1e4 / torch.finfo(torch.float8_e4m3fn).max,
           "q2": (get_preset("gpt2-124m").padded_vocab(128).vocab_size - 50257) / 50257 * 100,   # only the head grows
           "q3": math.ceil(math.ceil(4096 / 256) * math.ceil(50304 / 128) / GPU_SPECS["H100"].sms)},
}


def test_digests_are_those_of_the_formulas():
    assert set(EXPECTED) == set(QUIZZES)
    for lesson, questions in QUIZZES.items():
        assert set(questions) == set(EXPECTED[lesson]), lesson
        for q, (digest, rtol, where) in questions.items():
            assert answer_digest(f"lesson {lesson} quiz {q}", EXPECTED[lesson][q], rtol) == digest, (lesson, q)
            assert where and not re.search(r"\d+\.\d{2,}", where), (lesson, q, where)


def test_quiz_accepts_right_answers_and_refuses_wrong_ones(capsys):
    for lesson, answers in EXPECTED.items():
        assert set(score(lesson, dict(answers)).values()) == {"right"}, lesson
    wrong = {"q1": EXPECTED["03"]["q1"] * 1.05, "q2": EXPECTED["03"]["q2"] + 1, "q3": "interleave"}
    assert all(v.startswith("not yet (section") for v in score("03", wrong).values())
    assert score("03", {"q1": None}) == {"q1": "not answered yet"}
    # q4's wrong turns: the ZB-V step without its fill (42, the paper's "zero bubble"), with a whole stage's fill or
    # ZB-H1's idle (28)
    assert all(score("03", {"q4": a})["q4"].startswith("not yet (section") for a in (42.0, 28.0))
    # lesson 11 q2's wrong turns: the others' spare places take the overflow (0), expert 0's excess over the others'
    # load (192), every token of the over-full expert (400)
    assert all(score("11", {"q2": a})["q2"].startswith("not yet (section") for a in (0, 192, 400))
    assert score("01", {"q4": "memory"}, run={"q4": "memory"}) == {"q4": "right"}
    quiz("03", {"q1": EXPECTED["03"]["q1"], "q2": None})
    assert capsys.readouterr().out == "q1: right\nq2: not answered yet\n1 of 2 right\n"


def test_check_answer_tolerance_and_kinds():
    d = answer_digest("x", 16.640625, 2e-3)
    check_answer("x", 16.64, d, rtol=2e-3)
    for bad in (16.8, -16.64, None, "16.64"):
        with pytest.raises(CheckFailed):
            check_answer("x", bad, d, rtol=2e-3)
    check_answer("n", 48.0, answer_digest("n", 48))                  # an integral float is the integer
    with pytest.raises(CheckFailed, match="wrong value"):
        check_answer("n", 47, answer_digest("n", 48))
    with pytest.raises(CheckFailed):
        check_answer("other name", 48, answer_digest("n", 48))        # salted with the question
    check_answer("w", " Same", answer_digest("w", "same"))
    check_answer("b", False, answer_digest("b", False))
    with pytest.raises(ValueError):
        answer_digest("x", [1, 2])


def test_no_notebook_spells_a_quiz_answer():
    """The lessons' quiz cells hold no expected value (numbers or words) and start unanswered."""
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        lesson = path.name[:2]
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        sources = ["".join(c["source"]) for c in cells]
        quiz_cells = [s for s in sources if "from course_lib.lessons.quizzes import quiz" in s]
        assert len(quiz_cells) >= 1, path.name
        text = "\n".join(quiz_cells)
        numbers = [float(t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
                   if t.type == tokenize.NUMBER]
        for q, value in EXPECTED[lesson].items():
            if isinstance(value, str):
                assert f'"{value}"' not in text.split("quiz(")[-1], (path.name, q)
            elif not isinstance(value, bool):
                assert not any(abs(x - value) <= 1e-9 * max(1, abs(value)) for x in numbers), (path.name, q, value)
        every_cell = "\n".join("".join(c["source"]) for c in cells)
        answers = re.findall(r"^(?:q\d\w*|answer_\w*) = (\S+)", every_cell, re.M)
        assert answers and all(v == "None" for v in answers), (path.name, answers)


def test_predictions_start_empty():
    """Every prediction a lesson asks for starts as None (or a dict of None): nothing to copy from."""
    import ast
    found = 0
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            for node in ast.walk(ast.parse("\n".join(l for l in "".join(cell["source"]).splitlines()
                                                     if not l.lstrip().startswith(("%", "!"))))):
                if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Name)):
                    continue
                name = node.targets[0].id
                if not re.match(r"(my_\w+|prediction\w*|predicted)$", name):
                    continue
                found += 1
                value = node.value
                empty = (isinstance(value, ast.Constant) and value.value is None) or (
                    isinstance(value, ast.Dict) and all(isinstance(v, ast.Constant) and v.value is None
                                                        for v in value.values))
                assert empty, f"{path.name}: {name} starts filled in"
    assert found >= 15
