"""scripts/plot_metrics.py: the PNG it writes and the data its lines hold, from synthetic metrics.jsonl files."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "scripts" / "plot_metrics.py")
plot_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_metrics)


def _write(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # json writes NaN as the trainer does
    return path


def _record(step: int, loss: float, **extra) -> dict:
    return {
        "step": step,
        "loss": loss,
        "grad_norm": 1.0 / step,
        "lr": 1e-3 * step,
        "tokens_per_sec": 100.0 * step,
        "mfu": 0.0,
        "memory_gib": 0.5,
        **extra,
    }


def _line(fig, gid: str):
    found = [line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == gid]
    assert len(found) == 1, f"expected one line {gid!r}, found {len(found)}"
    return found[0]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def two_runs(tmp_path):
    # Run a was resumed from step 2: steps 3 and 4 were logged twice, the second time with other losses.
    a = _write(
        tmp_path / "a" / "metrics.jsonl",
        [
            _record(1, 5.0),
            _record(2, 4.0),
            _record(3, 3.5),
            _record(4, 3.4, val_loss=3.9),
            _record(3, 3.0),
            _record(4, 2.5, val_loss=2.9),
            _record(5, 2.0),
        ],
    )
    # Run b skipped step 2 (non-finite gradient norm, written as NaN).
    b = _write(
        tmp_path / "b" / "metrics.jsonl",
        [_record(1, 5.1), {**_record(2, 4.5), "grad_norm": float("nan"), "skipped": True}, _record(3, 4.2)],
    )
    return a, b


def test_two_runs_overlaid_hold_the_last_record_of_each_step(tmp_path, two_runs):
    a, b = two_runs
    out = tmp_path / "plots" / "both.png"
    fig = plot_metrics.main([str(a), str(b.parent), "--labels", "a,b", "--out", str(out), "--dpi", "50"])

    # loss, val_loss, lr, grad_norm, tokens_per_sec: 2 columns x 3 rows of 6.4 x 3.4-inch panels at 50 dpi
    assert _png_size(out) == (2 * 320, 3 * 170)
    assert [ax.get_title() for ax in fig.axes] == [
        "training loss",
        "validation loss",
        "learning rate",
        "gradient norm (before clipping)",
        "tokens/s per device",
    ]
    loss_a = _line(fig, "a:loss")
    np.testing.assert_array_equal(loss_a.get_xdata(), [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(loss_a.get_ydata(), [5.0, 4.0, 3.0, 2.5, 2.0])  # the resumed run's records win
    np.testing.assert_array_equal(_line(fig, "a:val_loss").get_ydata(), [2.9])
    np.testing.assert_array_equal(_line(fig, "b:loss").get_ydata(), [5.1, 4.5, 4.2])
    # the NaN gradient norm is left out of the line and step 2 of b is marked on every panel instead
    grad_b = _line(fig, "b:grad_norm")
    np.testing.assert_array_equal(grad_b.get_xdata(), [1, 3])
    marks = [line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == "b:skipped"]
    assert len(marks) == 5 and all(list(m.get_xdata()) == [2, 2] for m in marks)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["a", "b"]


def test_smoothing_draws_the_trailing_mean_over_the_raw_line(tmp_path):
    losses = [6.0, 2.0, 4.0, 8.0, 1.0]
    f = _write(tmp_path / "r" / "metrics.jsonl", [_record(i + 1, v) for i, v in enumerate(losses)])
    fig = plot_metrics.main([str(f), "--metrics", "loss", "--smooth", "2", "--out", str(tmp_path / "s.png")])
    np.testing.assert_array_equal(_line(fig, "r:loss").get_ydata(), losses)
    np.testing.assert_allclose(_line(fig, "r:loss:smoothed").get_ydata(), [6.0, 4.0, 3.0, 6.0, 4.5])
    assert _png_size(tmp_path / "s.png") == (640, 340)


def test_wall_time_axis_counts_from_the_first_record(tmp_path):
    f = _write(
        tmp_path / "r" / "metrics.jsonl",
        [_record(1, 3.0, time="2026-11-23T08:00:00+00:00"), _record(2, 2.0, time="2026-11-23T08:00:30+00:00")],
    )
    fig = plot_metrics.main([str(f), "--metrics", "loss", "--x", "time", "--out", str(tmp_path / "t.png")])
    np.testing.assert_array_equal(_line(fig, "r:loss").get_xdata(), [0.0, 30.0])
    g = _write(tmp_path / "e" / "metrics.jsonl", [_record(1, 3.0, elapsed_s=4.0), _record(2, 2.0, elapsed_s=9.5)])
    fig = plot_metrics.main([str(g), "--metrics", "loss", "--x", "time", "--out", str(tmp_path / "e.png")])
    np.testing.assert_array_equal(_line(fig, "e:loss").get_xdata(), [4.0, 9.5])


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such file or folder"),
        ("empty", "is empty"),
        ("folder-without-file", "folder without metrics.jsonl"),
        ("bad-line", r"metrics.jsonl:2 is not JSON"),
        ("label-count", "--labels names 2 runs but 1 were given"),
        ("unknown-metric", r"no run has \['val_ppl'\]"),
        ("time-without-fields", "--x time needs a 'time' or 'elapsed_s' field"),
    ],
)
def test_bad_input_exits_naming_the_problem(tmp_path, case, message):
    good = _write(tmp_path / "good" / "metrics.jsonl", [_record(1, 3.0)])
    run, extra = str(good), []
    if case == "missing":
        run = str(tmp_path / "nope" / "metrics.jsonl")
    elif case == "empty":
        run = str(_write(tmp_path / "empty" / "metrics.jsonl", []))
    elif case == "folder-without-file":
        (tmp_path / "bare").mkdir()
        run = str(tmp_path / "bare")
    elif case == "bad-line":
        (tmp_path / "bad").mkdir()
        (tmp_path / "bad" / "metrics.jsonl").write_text(json.dumps(_record(1, 3.0)) + '\n{"step": 2, "lo\n')
        run = str(tmp_path / "bad")
    elif case == "label-count":
        extra = ["--labels", "x,y"]
    elif case == "unknown-metric":
        extra = ["--metrics", "loss,val_ppl"]
    elif case == "time-without-fields":
        extra = ["--x", "time"]
    out = tmp_path / "out.png"
    with pytest.raises(SystemExit, match=message):
        plot_metrics.main([run, "--out", str(out), *extra])
    assert not out.exists()


def test_trailing_mean_matches_a_plain_loop():
    y = np.array([3.0, -1.0, 4.0, 1.0, -5.0, 9.0, 2.0])
    for window in (1, 3, 10):
        expected = [np.mean(y[max(0, i - window + 1) : i + 1]) for i in range(len(y))]
        np.testing.assert_allclose(plot_metrics.trailing_mean(y, window), expected)
    assert math.isclose(plot_metrics.trailing_mean(np.array([2.0]), 5)[0], 2.0)
