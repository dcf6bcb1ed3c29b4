"""Lesson 09's monitoring: scalars written to real TensorBoard event files read back equal through TensorBoard's
own EventAccumulator; the JSON-lines stream followed with a torn last line; the live plot draws the data."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from course_lib.training.monitor import JSONL_NAME, LivePlot, MetricsWriter, follow, read_scalars


def _metrics(step: int) -> dict:
    return {"loss": 4.0 / (1 + step) + 1 / 3, "lr": 3e-4 * (step + 1) / 5, "grad_norm": 1.0 + 0.1 * step,
            "tokens_per_s": 51234.5 + step}


def test_written_scalars_read_back_through_tensorboard(tmp_path):
    steps = [0, 1, 2, 5, 9]
    with MetricsWriter(tmp_path / "tb") as writer:
        for s in steps:
            writer.write(s, {**_metrics(s), "sync_time_s": torch.tensor(0.25)}, time=1.7e9 + s)
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    got = read_scalars(tmp_path / "tb")
    assert set(got) == {"loss", "lr", "grad_norm", "tokens_per_s", "sync_time_s"}
    for name in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert [s for s, _ in got[name]] == steps
        # TensorBoard stores float32: equal to the float32 rounding of each value, exactly
        assert [v for _, v in got[name]] == [float(np.float32(_metrics(s)[name])) for s in steps]
    assert got["sync_time_s"] == [(s, 0.25) for s in steps]
    # The JSON lines hold the same records at full precision, with their time.
    records, _ = follow(tmp_path / "tb" / JSONL_NAME)
    assert [r["step"] for r in records] == steps and [r["time"] for r in records] == [1.7e9 + s for s in steps]
    assert [r["loss"] for r in records] == [_metrics(s)["loss"] for s in steps]


def test_a_disabled_writer_writes_nothing(tmp_path):
    with MetricsWriter(tmp_path / "tb", enabled=False) as writer:     # rank != 0
        writer.write(0, {"loss": 1.0})
        writer.flush()
    assert not (tmp_path / "tb").exists()
    with pytest.raises(ValueError, match="reserved"):
        MetricsWriter(tmp_path / "tb2").write(0, {"step": 1.0})


def test_follow_leaves_a_torn_last_line_for_the_next_call(tmp_path):
    path = tmp_path / JSONL_NAME
    assert follow(path) == ([], 0)                                   # not written yet
    whole = [json.dumps({"step": s, "loss": 1.0 / (s + 1)}) + "\n" for s in range(4)]
    path.write_text(whole[0] + whole[1] + whole[2][:7])              # the writer is in the middle of line 2
    records, offset = follow(path)
    assert [r["step"] for r in records] == [0, 1] and offset == len(whole[0] + whole[1])
    assert follow(path, offset) == ([], offset)                      # still torn: nothing new
    with open(path, "a") as f:
        f.write(whole[2][7:] + whole[3])
    records, offset2 = follow(path, offset)
    assert [r["step"] for r in records] == [2, 3] and offset2 == path.stat().st_size
    path.write_text(whole[0])                                        # a new run wrote the file again
    assert [r["step"] for r in follow(path, offset2)[0]] == [0]


def test_follow_reads_what_a_writer_flushes_and_nan(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(0, {"loss": 2.0})
    records, offset = follow(tmp_path / JSONL_NAME)                  # before close: every line is flushed
    writer.write(1, {"loss": float("nan")})
    more, _ = follow(tmp_path / JSONL_NAME, offset)
    writer.close()
    assert [r["loss"] for r in records] == [2.0] and math.isnan(more[0]["loss"])


def test_live_plot_draws_the_records(tmp_path):
    plot = LivePlot(title="test run")
    assert len([ax for ax in plot.figure.axes if ax.get_visible()]) == 4
    recs = [{"step": s, "time": 0.0, **_metrics(s)} for s in range(6)]
    plot.update(recs[:3])
    plot.update(recs[3:])
    axes = {ax.get_title(): ax for ax in plot.figure.axes}
    for name in plot.metrics:
        (line,) = axes[name].get_lines()
        assert list(line.get_xdata()) == list(range(6))
        assert list(line.get_ydata()) == [_metrics(s)[name] for s in range(6)]
        lo, hi = axes[name].get_ylim()
        assert lo <= min(line.get_ydata()) and max(line.get_ydata()) <= hi     # rescaled to the data
    # A resumed run writes steps 4, 5 again (other values): they replace the old points, as in TensorBoard.
    plot.update([{"step": 4, "loss": 9.0}, {"step": 5, "loss": 8.0}])
    (line,) = axes["loss"].get_lines()
    assert list(line.get_xdata()) == list(range(6))
    assert list(line.get_ydata())[4:] == [9.0, 8.0]
    assert plot.data("lr")[0] == list(range(6))                     # a metric the records lack keeps its points


def test_live_plot_in_a_notebook_updates_one_display_in_place(monkeypatch):
    """In Jupyter: shown once with a display_id, then that display is updated (no new output per update)."""
    import IPython.display

    from course_lib.training import monitor

    shown = []

    class Handle:
        def update(self, obj):
            shown.append(("update", obj))

    def fake_display(obj, display_id=None):
        assert display_id is True
        shown.append(("display", obj))
        return Handle()

    monkeypatch.setattr(monitor, "_in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", fake_display)
    plot = LivePlot(metrics=("loss",))
    for s in range(3):
        plot.update([{"step": s, "loss": 1.0 / (s + 1)}])
    assert [kind for kind, _ in shown] == ["display", "update", "update"]
    assert all(obj.data[:8] == b"\x89PNG\r\n\x1a\n" for _, obj in shown)
