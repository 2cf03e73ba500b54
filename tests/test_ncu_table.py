"""benchmarks/ncu_table.py on ncu's long CSV form (a synthetic file in its layout): the header found after ncu's and
the program's own lines, launches of one kernel averaged, names cut at their arguments, units kept, text values
skipped, the filters, and a clear error for input without the header."""

import pytest

from benchmarks import ncu_table

HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Section Name","Metric Name",'
    '"Metric Unit","Metric Value"'
)


def _row(launch, kernel, metric, unit, value):
    return (
        f'"{launch}","1","python3","h","{kernel}","1","7","Command line profiler metrics","{metric}","{unit}","{value}"'
    )


CSV = "\n".join(
    [
        "==PROF== Connected to process 1",
        "profiled one forward + backward at 1.3b (seq_idx True)",
        HEADER,
        _row(0, "chained_states_fwd_kernel(float*, int)", "gpu__time_duration.sum", "us", "160"),
        _row(0, "chained_states_fwd_kernel(float*, int)", "sm__pipe_fma_cycles_active.avg.pct", "%", "40"),
        _row(1, "chunk_scan_fwd_kernel", "gpu__time_duration.sum", "us", "1,208.5"),
        _row(1, "chunk_scan_fwd_kernel", "sm__pipe_fma_cycles_active.avg.pct", "%", "55"),
        _row(1, "chunk_scan_fwd_kernel", "sm__pipe_xu_cycles_active.avg.pct", "%", "70"),
        _row(1, "chunk_scan_fwd_kernel", "rule message", "", "n/a"),
        _row(2, "chained_states_fwd_kernel(float*, int)", "gpu__time_duration.sum", "us", "170"),
        _row(2, "chained_states_fwd_kernel(float*, int)", "sm__pipe_fma_cycles_active.avg.pct", "%", "44"),
    ]
)


def test_table_averages_launches_and_keeps_units():
    table = ncu_table.read_ncu_csv(CSV)
    assert set(table) == {"chained_states_fwd_kernel", "chunk_scan_fwd_kernel"}
    assert table["chained_states_fwd_kernel"]["gpu__time_duration.sum (us)"] == pytest.approx(165.0)
    assert table["chained_states_fwd_kernel"]["sm__pipe_fma_cycles_active.avg.pct (%)"] == pytest.approx(42.0)
    assert table["chunk_scan_fwd_kernel"]["gpu__time_duration.sum (us)"] == pytest.approx(1208.5)
    assert "rule message" not in table["chunk_scan_fwd_kernel"]
    md = ncu_table.markdown(table, ["pipe_"])
    assert (
        md.splitlines()[0]
        == "| kernel | sm__pipe_fma_cycles_active.avg.pct (%) | sm__pipe_xu_cycles_active.avg.pct (%) |"
    )
    assert "| chained_states_fwd_kernel | 42 |  |" in md
    top = ncu_table.markdown(table, ["pipe_"], top=1)
    assert "| chunk_scan_fwd_kernel | sm__pipe_xu_cycles_active.avg.pct (%) 70 |" in top


def test_input_without_header_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="--csv"):
        ncu_table.read_ncu_csv("==PROF== nothing profiled\n")
    path = tmp_path / "ncu.txt"
    path.write_text("plain ncu text output\n")
    with pytest.raises(SystemExit):
        ncu_table.main([str(path)])
    assert "was ncu run with --csv" in capsys.readouterr().err


def test_missing_file_and_negative_top_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ncu_table.main([str(tmp_path / "absent.csv")])
    assert "cannot read" in capsys.readouterr().err
    path = tmp_path / "ncu.csv"
    path.write_text(CSV)
    with pytest.raises(SystemExit):
        ncu_table.main([str(path), "--top", "-1"])
    assert "--top -1" in capsys.readouterr().err
    ncu_table.main([str(path), "--metrics", "pipe_xu", "--top", "1"])
    assert "| chunk_scan_fwd_kernel | sm__pipe_xu_cycles_active.avg.pct (%) 70 |" in capsys.readouterr().out
