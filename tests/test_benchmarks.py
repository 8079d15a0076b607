"""The benchmarks run (on tiny inputs); their timings are never asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import Table, run


def test_runner_finds_the_benchmarks() -> None:
    assert "bench_open" in run.discover()


def test_row_dicts_become_a_table() -> None:
    import types

    module = types.ModuleType("bench_x", "Something measured.\n\nMore text.")
    (table,) = run.as_tables([{"a": 1, "b": 2.5}, {"a": 3, "b": 4}], module)
    assert table.title == "Something measured"
    assert table.columns == ["a", "b"] and table.rows == [["1", "2.5"], ["3", "4"]]
    with pytest.raises(TypeError):
        run.as_tables([1, 2], module)


def test_table_markdown() -> None:
    table = Table("T", ["method", "ms"], [["a", "1.0"]], ["a note"])
    assert table.to_markdown() == "### T\n\n| method | ms |\n|---|---:|\n| a | 1.0 |\n\n- a note\n"


def test_open_benchmark_runs(tmp_path: Path) -> None:
    from benchmarks import bench_open

    (table,) = bench_open.run(quick=True, n_tensors=25, repeats=1, directory=tmp_path)
    methods = [row[0] for row in table.rows]
    assert len(methods) == 4
    assert any("ucpformat.open" in m for m in methods)
    assert any("inspect" in m for m in methods)


def test_runner_writes_a_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_open

    monkeypatch.setattr(bench_open, "N_TENSORS", 20)
    out = tmp_path / "report.md"
    assert run.main(["--quick", "--only", "open", "--output", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# ucpformat benchmarks (quick)")
    assert "Open a checkpoint of 20 tensors" in text
    assert "Open a checkpoint of 20 tensors" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run.main(["--only", "nonexistent"])
