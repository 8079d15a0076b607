"""The benchmarks run (on tiny inputs); their timings are never asserted."""

from __future__ import annotations

import json
import re
import subprocess
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
    assert len(methods) == 6
    assert any("ucpformat.open" in m for m in methods)
    assert any("inspect" in m for m in methods)


def test_validate_benchmark_runs(tmp_path: Path) -> None:
    from benchmarks import bench_validate

    (table,) = bench_validate.run(quick=True, n_arrays=30, repeats=1, directory=tmp_path)
    rows = {(row[0], row[1].split(" (")[0]) for row in table.rows}
    assert len(table.rows) == 8
    assert ("each document different", "`ucpformat.validate`") in rows
    assert ("documents alike", "read and parse the root zarr.json") in rows
    assert any("ucp validate" in row[1] for row in table.rows)


def test_runner_writes_a_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_open

    monkeypatch.setattr(bench_open, "QUICK_TENSORS", 20)
    out = tmp_path / "report.md"
    assert run.main(["--quick", "--only", "open", "--output", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# ucpformat benchmarks (quick)")
    assert "Open a checkpoint of 20 tensors" in text
    assert "Open a checkpoint of 20 tensors" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run.main(["--only", "nonexistent"])


# -- the throughput benchmarks, on tiny states ---------------------------------------------


def test_synthetic_state_is_transformer_like() -> None:
    from benchmarks import state

    defs = list(state.tensors(2048))
    total = sum(d.nbytes for d in defs)
    assert 1.9 * 2**30 < total < 2.2 * 2**30
    assert {d.dtype for d in defs} == {"bfloat16", "float32"}
    assert {d.tp_dim for d in defs} == {0, 1, None}
    assert len(list(state.tensors(4))) < len(defs)


@pytest.mark.torch
def test_throughput_benchmark_runs(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from benchmarks import bench_throughput

    tables = bench_throughput.run(size_mib=1, repeats=1, directory=tmp_path)
    main, blocked = tables
    assert main.rows[0][0].startswith("**limit**")
    assert any("DCP" in row[0] for row in main.rows)
    assert set(main.data["rows"]) >= {"raw", "dcp", "ucpformat", "ucpformat staged",
                                      "ucpformat in_place"}
    assert set(main.data["staged_over_in_place"]) == {"cold", "warm"}
    assert "blocked" in blocked.title.lower()
    assert run.chart([main], tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 1000


@pytest.mark.torch
def test_tuning_and_compression_benchmarks_run(tmp_path: Path) -> None:
    from benchmarks import bench_compression, bench_tuning

    chunks, shards = bench_tuning.run(size_mib=1, directory=tmp_path, quick=True)
    assert len(chunks.rows) == len(bench_tuning.CHUNK_SIZES)
    assert len(shards.rows) == len(bench_tuning.SHARD_SIZES)
    (comp,) = bench_compression.run(size_mib=1, directory=tmp_path, quick=True)
    assert [r[0] for r in comp.rows] == [label for label, _ in bench_compression.CODECS]


@pytest.mark.torch
@pytest.mark.slow
def test_memory_benchmark_runs_in_fresh_processes(tmp_path: Path) -> None:
    from benchmarks import bench_memory

    (table,) = bench_memory.run(quick=True, size_mib=1, directory=tmp_path)
    # raw, ucpformat save/load, ucpformat load into a model staged and in place
    assert len(table.rows) == 4
    assert {"ucpformat staged", "ucpformat in_place"} <= set(table.data["load"])
    assert table.data["save"]["ucpformat"] > 0


@pytest.mark.torch
@pytest.mark.slow
def test_resume_benchmark_times_each_load_in_a_fresh_process(tmp_path: Path) -> None:
    from benchmarks import bench_resume

    methods = ("staged", "load_state_dict")  # each a new process: two keep the test short
    (table,) = bench_resume.run(size_mib=1, repeats=1, directory=tmp_path, methods=methods)
    assert [row[0] for row in table.rows] == [bench_resume.LABELS[m] for m in methods]
    for method, figures in table.data.items():
        assert figures["cold_s"] > 0 and figures["warm_s"] > 0, method
    assert table.data["load_state_dict"]["warm_over_load_state_dict"] == 1.0
    assert table.data["load_state_dict"]["warm_cpu_over_load_state_dict"] == 1.0
    assert table.data["staged"]["warm_cpu_s"] > 0


@pytest.mark.torch
@pytest.mark.slow
def test_memory_benchmark_does_not_inherit_the_parents_peak(tmp_path: Path) -> None:
    """A child's peak is its own, however much its parent holds (ru_maxrss is not)."""
    import numpy as np

    from benchmarks import bench_memory

    held = np.ones(640 * 2**20, dtype=np.uint8)  # 640 MiB, touched, in the parent
    (table,) = bench_memory.run(quick=True, size_mib=1, directory=tmp_path)
    assert held[-1] == 1
    for op in ("save", "load"):
        for method, peak in table.data[op].items():
            assert 0 < peak < 256 * 2**20, (op, method, peak)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.distributed
def test_distributed_benchmark_runs(tmp_path: Path) -> None:
    from benchmarks import bench_distributed

    main, reshard = bench_distributed.run(size_mib=1, repeats=1, directory=tmp_path)
    assert [r[0] for r in main.rows] == [
        "save (4 ranks)", "load, cold (4 ranks)", "load, warm (4 ranks)"]
    assert len(reshard.rows) == 2
    assert set(main.data["dist"]) >= {"save, 4 ranks", "load cold, 4 ranks"}


def test_update_doc_replaces_only_the_generated_part(tmp_path: Path) -> None:
    doc = tmp_path / "B.md"
    doc.write_text(f"# Title\n\nintro\n\n{run.BEGIN}\nold\n{run.END}\n\n## Notes\nmine\n")
    run.update_doc(doc, "new table")
    text = doc.read_text()
    assert "old" not in text and "new table" in text
    assert text.startswith("# Title\n\nintro") and text.endswith("## Notes\nmine\n")


@pytest.mark.torch
def test_flat_api_benchmark_runs(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from benchmarks import bench_flat

    table, ladder, floor = bench_flat.run(quick=True, size_mib=2, repeats=1,
                                          directory=tmp_path, durable=False,
                                          ladder_mib=(0.25, 1))
    operations = [row[0] for row in table.rows]
    assert operations[0].startswith("`save_file`") and len(operations) == 4
    assert any("get_slice" in op for op in operations)
    assert set(table.data["flat"]) == set(operations)
    # load and touch at each size, with the file counts
    assert len(ladder.rows) == 2 and all(row[2].startswith("1 / ") for row in ladder.rows)
    assert set(ladder.data["flat_ladder"]) == {"0.25", "1"}
    # the loads alone beside the checks alone, which add up
    assert len(floor.rows) == 2
    for figures in ladder.data["flat_ladder"].values():
        checks = figures["checks"]
        assert checks["directory"] > 0 and checks["root"] > 0 and checks["crc32c"] > 0
        assert checks["checks"] == pytest.approx(
            checks["directory"] + checks["root"] + checks["crc32c"])


@pytest.mark.torch
def test_scale_benchmark_runs(tmp_path: Path) -> None:
    """The scale simulation on a tiny model: every table, the figures consistent."""
    from benchmarks import bench_scale
    from benchmarks import scale_layouts as L

    tiny = L.Transformer("tiny", layers=16, hidden=64, heads=8, kv_heads=8, head_dim=8,
                         ffn=128, vocab=512)
    tables = bench_scale.run(dps=(1, 2), model=tiny, moe=False, fsdp=False,
                             directory=tmp_path)
    assert [t.title.split(":")[0] for t in tables] == [
        "Distributed save at scale", "Before", "DCP's default planners on the same state",
        "Resharded load from the largest save"]
    rows = tables[0].data["save"]
    assert [r["ranks"] for r in rows] == [128, 256]
    for r in rows:
        # a rank now receives its share, not every rank's description
        assert r["rank_received"] < r["before_rank_received"]
        assert r["objects"] >= r["arrays"] > 0 and r["root_bytes"] > 0
        assert r["dcp_metadata_bytes"] > 0
    tp_rank, one_rank = tables[0].data["load"]
    # a TP 4 x PP 8 rank reads about 1/32 of the state (its stage's TP shard), far below
    # 1/16 of what one rank reading everything needs
    assert 0 < tp_rank["needed_bytes"] * 16 <= one_rank["needed_bytes"]
    assert one_rank["target_ranks"] == 1
    # one rank reads every element once: bf16 weights, fp32 master and two moments
    assert one_rank["needed_bytes"] == tiny.parameters() * (2 + 3 * 4)
    assert one_rank["amplification"] >= 1.0


@pytest.mark.torch
def test_scale_benchmark_fsdp_on_a_mesh(tmp_path: Path) -> None:
    """FSDP2 x TP, DTensors described by mesh: the whole model and 2 of its layers (what
    DCP plans beside it), and what a rank sends and receives stays small."""
    from benchmarks import bench_scale
    from benchmarks import scale_layouts as L

    tiny = L.Transformer("tiny", layers=6, hidden=64, heads=8, kv_heads=8, head_dim=8,
                         ffn=128, vocab=512)
    tables = bench_scale.run(dps=(1,), fsdp_dps=(4,), model=tiny, moe=False,
                             directory=tmp_path)
    rows = [r for r in tables[0].data["save"] if "FSDP2" in r["layout"]]
    assert [(r["ranks"], r["arrays"]) for r in rows] == [(32, 3 * (2 * 9 + 3)),
                                                          (32, 3 * (6 * 9 + 3))]
    shallow, whole = rows
    assert "dcp_global_s" in shallow and "dcp_global_s" not in whole
    for r in rows:
        assert r["rank_received"] < r["before_rank_received"] and r["objects"] >= r["arrays"]
    # a rank's share grows with the classes of alike tensors, not with the layers
    assert whole["share_bytes"] < 2 * shallow["share_bytes"]


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_benchmark_runs(tmp_path: Path) -> None:
    """Both paths run on 4 ranks and ZeRO-2/3; DeepSpeed's path writes more (per-rank
    files, the universal copy and its temporary slices) than the consolidated save."""
    pytest.importorskip("deepspeed")
    from benchmarks import bench_deepspeed

    (table,) = bench_deepspeed.run(hidden=32, layers=2, repeats=1, workdir=tmp_path / "work")
    assert [row[0].split(":")[0] for row in table.rows] == ["ZeRO-2"] * 2 + ["ZeRO-3"] * 2
    for stage in ("zero2", "zero3"):
        figures = table.data[stage]
        assert figures["ucpformat"]["seconds"] > 0 and figures["deepspeed"]["seconds"] > 0
        assert 0 < figures["ucpformat"]["written"] < figures["deepspeed"]["written"]
        assert figures["held"] > figures["largest"] > 0
    assert not any((tmp_path / "work").iterdir())  # every checkpoint removed


@pytest.mark.slow
@pytest.mark.distributed
def test_megatron_benchmark_runs(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from benchmarks import bench_megatron

    (table,) = bench_megatron.run(quick=True, repeats=1, directory=tmp_path)
    assert [r[0] for r in table.rows] == ["save (4 ranks)", *bench_megatron.TARGET_LABELS.values()]
    assert any("files per checkpoint" in n for n in table.notes)


def test_staging_and_gpu_benchmarks_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_gpu, bench_staging

    (table,) = bench_staging.run(quick=True, size_mib=2, repeats=1, directory=tmp_path)
    assert [row[0].split(" (")[0] for row in table.rows] == [
        "unstaged", "default", "through the pool"]
    if not bench_gpu.cuda_available():  # measured only where CUDA exists
        assert bench_gpu.run(quick=True) == []
        assert bench_gpu.main([]) == 0
        assert "no CUDA device" in capsys.readouterr().out


def test_gpu_benchmark_steps_dry_run_on_the_cpu(tmp_path: Path) -> None:
    """``bench_gpu --dry-run``: every step on a tiny CPU state; the calls to ucpformat,
    DCP and torch work and every figure is produced (the GPU machine then only
    measures)."""
    from benchmarks import bench_gpu

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = tmp_path / "m.json"
    assert bench_gpu.main(["--dry-run", "--dir", str(scratch), "--json", str(out)]) == 0
    assert bench_gpu.DEVICE == "cuda"  # restored after the dry run
    (m,) = json.loads(out.read_text())
    assert m["errors"] == {} and m["gib"] == bench_gpu.DRY_RUN_GIB
    assert {key for key, _ in bench_gpu.LABELS} <= set(m["seconds"])
    assert set(bench_gpu.ratios(m)) == {
        "async_blocked_over_d2h", "async_blocked_over_dcp_async", "sync_save_over_limit",
        "load_over_limit", "sync_save_speed_over_dcp", "load_speed_over_dcp"}
    assert len(bench_gpu.table(m, "cpu dry run").rows) == len(bench_gpu.LABELS)
    assert list(scratch.iterdir()) == []  # every checkpoint removed once measured


def test_the_gpu_session_script_parses_and_names_existing_tests() -> None:
    """``benchmarks/gpu_run.sh`` runs only where a GPU is lent, minutes at a time: a
    syntax error or a renamed test module must show here, not on the device."""
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_run.sh"
    for path in (script, script.with_name("gpu_wheels.sh")):
        subprocess.run(["bash", "-n", str(path)], check=True)
    named = re.findall(r"tests/[\w/]+\.py", script.read_text())
    assert "tests/torch/test_cuda.py" in named
    for path in named:
        assert (script.parents[1] / path).is_file(), path


def test_gpu_deepspeed_benchmark_and_async_profile_dry_run_on_the_cpu(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The two GPU-session extras run every step on a tiny CPU state: the DeepSpeed
    path's figures are all produced and its scratch removed; the profile names the
    saver's functions and the blocked-time ratio."""
    from benchmarks import bench_gpu_deepspeed, profile_gpu_async

    out = tmp_path / "ds.json"
    assert bench_gpu_deepspeed.main(["--dry-run", "--dir", str(tmp_path),
                                     "--json", str(out)]) == 0
    (m,) = json.loads(out.read_text())
    assert m["errors"] == {}
    assert {key for key, _ in bench_gpu_deepspeed.LABELS} <= set(m["seconds"])
    assert set(bench_gpu_deepspeed.ratios(m)) == {
        "deepspeed_sync_speed_over_ucp_save", "deepspeed_sync_time_over_d2h",
        "deepspeed_async_blocked_over_d2h"}
    assert [p.name for p in tmp_path.iterdir()] == ["ds.json"]
    capsys.readouterr()
    assert profile_gpu_async.main(["--dry-run", "--top", "5", "--dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "blocked / D2H" in text and "async_save.py" in text and "--- by tottime" in text
