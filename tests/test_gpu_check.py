"""`course gpu-check` on this machine (no GPU here: CPU ranks over gloo, NCCL's rules checked), and its verdict."""

from __future__ import annotations

from course_lib.instructor import cli, gpu_check


def test_gpu_check_passes_on_this_machine(capsys):
    assert cli.main(["gpu-check", "--timeout", "150"]) == 0
    out = capsys.readouterr().out
    for words in ("launcher, 1 rank(s)", "launcher, 2 rank(s)", "all_reduce (sum, int64), 2 ranks",
                  "send/recv (batch_isend_irecv), 4 ranks", "ring all-reduce, 2 ranks", "ring all-reduce, 4 ranks",
                  "naive pipeline, p = 2", "gpipe pipeline, p = 4", "1f1b pipeline, p = 4",
                  "model state of an AdamW step", "bf16 / fp32 matmul speed", "OK:"):
        assert words in out, words
    assert "FAIL" not in out


def test_gpu_check_exits_non_zero_on_a_failure(monkeypatch, capsys):
    checks = [gpu_check.Check("ring all-reduce, 2 ranks", "done within 30 s", "timed out", False),
              gpu_check.Check("launcher, 1 rank(s)", "gloo", "gloo", True),
              gpu_check.Check("bf16 matmul vs datasheet", "not a GPU", "1 GFLOP/s", None)]
    monkeypatch.setattr(gpu_check, "run_checks", lambda timeout_s: checks)
    assert gpu_check.main() == 1
    out = capsys.readouterr().out
    assert "FAILED: ring all-reduce, 2 ranks" in out and "  pass" in out and "  FAIL" in out
