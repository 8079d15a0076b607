"""The distributed writer: one writer per shard, replicas once, all-or-nothing commit."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.cli import main as ucp_main
from ucpformat.distributed import Fragment, TensorSpec, save_fragments
from ucpformat.distributed.comm import ThreadGroup, run_threads
from ucpformat.errors import CheckpointNotFoundError, IncompleteCheckpointError, WriteError
from ucpformat.store import LocalStore


def _replicated_state(n: int = 8) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(3)
    return {
        f"model/layers.{i}.w": rng.standard_normal((64, 32)).astype(np.float32) for i in range(n)
    }


def _full_fragments(
    state: dict[str, np.ndarray[Any, Any]],
) -> tuple[list[TensorSpec], list[Fragment]]:
    specs = [TensorSpec(p, a.shape, "float32") for p, a in state.items()]
    frags = [Fragment(p, tuple((0, n) for n in a.shape), a) for p, a in state.items()]
    return specs, frags


def test_replicas_are_written_once_and_balanced(tmp_path: Path) -> None:
    state = _replicated_state()
    specs, frags = _full_fragments(state)

    def rank_main(comm: ThreadGroup) -> Any:
        return save_fragments(
            tmp_path / "ckpt",
            comm,
            specs=specs,
            fragments=frags,
            chunk_bytes=2048,
            min_shard_bytes=1024,
            durable=False,
        )

    results = run_threads(4, rank_main)
    written = [r.bytes_written_here for r in results]
    objects = sum(r.objects_written_here for r in results)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.ucp.json").read_text())
    stored = [k for k in manifest["files"] if not k.endswith("zarr.json")]
    assert objects == len(stored)  # every stored object written by exactly one rank
    assert all(w > 0 for w in written)  # the work is spread over the replicas
    assert max(written) <= 1.5 * min(written)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    for path, want in state.items():
        assert np.array_equal(ckpt[path].read(), want)


def test_a_failing_rank_leaves_no_committed_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UCP-1.0-R132: one rank's write fails -> every rank raises, nothing is committed."""
    state = _replicated_state()
    specs, frags = _full_fragments(state)
    calls = {"n": 0}
    real_create = LocalStore.create  # stored objects are created, never replaced (R059)

    def flaky_create(self: LocalStore, key: str, buffers: Any, *, atomic: bool = False) -> int:
        if "/c/" in key or key.endswith("/c"):
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(28, "No space left on device")
        return real_create(self, key, buffers, atomic=atomic)

    monkeypatch.setattr(LocalStore, "create", flaky_create)
    errors: list[BaseException] = []

    def rank_main(comm: ThreadGroup) -> Any:
        try:
            return save_fragments(
                tmp_path / "ckpt",
                comm,
                specs=specs,
                fragments=frags,
                chunk_bytes=2048,
                min_shard_bytes=1024,
                durable=False,
                workers=1,
            )
        except WriteError as exc:
            errors.append(exc)
            return None

    run_threads(4, rank_main)
    assert len(errors) == 4  # every rank reports the failure
    assert any("No space left" in str(e) for e in errors)
    assert not (tmp_path / "ckpt" / "zarr.json").exists()
    with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)) as info:
        ucpformat.open(tmp_path / "ckpt")
    assert info.value.rule == "UCP-1.0-R051"
    # rank 0 removed what every rank wrote (UCP-1.0-R049)
    assert not [p for p in (tmp_path / "ckpt").rglob("*") if not p.is_dir()]
    monkeypatch.setattr(LocalStore, "create", real_create)
    run_threads(
        4,
        lambda comm: save_fragments(
            tmp_path / "ckpt", comm, specs=specs, fragments=frags, durable=False
        ),
    )
    assert np.array_equal(
        ucpformat.open(tmp_path / "ckpt")["model/layers.0.w"].read(), state["model/layers.0.w"]
    )


def test_ranks_that_disagree_on_a_tensor_are_refused(tmp_path: Path) -> None:
    a = np.zeros((4, 4), np.float32)

    def rank_main(comm: ThreadGroup) -> Any:
        shape = (4, 4) if comm.rank == 0 else (4, 5)
        return save_fragments(
            tmp_path / "ckpt",
            comm,
            specs=[TensorSpec("model/w", shape, "float32")],
            fragments=[Fragment("model/w", ((0, 4), (0, 4)), a)],
        )

    with pytest.raises(ucpformat.errors.LayoutError) as info:
        run_threads(2, rank_main)
    assert info.value.rule == "UCP-1.0-R131"
    assert not (tmp_path / "ckpt").exists()


def test_inspect_and_validate_show_layout_semantics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    layout = {
        "tp": {"dim": 0},
        "parts": [{"name": "q", "size": 8}, {"name": "k", "size": 4}],
        "groups": 4,
    }
    w = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)

    def rank_main(comm: ThreadGroup) -> Any:
        rows = slice(comm.rank * 6, comm.rank * 6 + 6)
        return save_fragments(
            tmp_path / "ckpt",
            comm,
            specs=[
                TensorSpec(
                    "model/qkv",
                    (12, 3),
                    "float32",
                    {"ucp": {"role": "parameter", "layout": layout}},
                )
            ],
            fragments=[Fragment("model/qkv", ((rows.start, rows.stop), (0, 3)), w[rows])],
        )

    run_threads(2, rank_main)
    assert ucp_main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "tp=dim0" in out and "q:8" in out and "k:4" in out
    assert ucp_main(["inspect", "--json", str(tmp_path / "ckpt")]) == 0
    doc = json.loads(capsys.readouterr().out)
    (tensor,) = doc["tensors"]
    assert tensor["attributes"]["layout"] == layout
    assert ucp_main(["validate", str(tmp_path / "ckpt")]) == 0


def test_run_threads_timeout_fails_a_collective_nobody_completes() -> None:
    """A rank that leaves without raising (so the barrier is not broken for the others)
    would leave them waiting forever; with a time limit, their collective fails."""

    def rank_main(comm: ThreadGroup) -> Any:
        if comm.rank == 1:
            return "left"
        return comm.allgather(comm.rank)

    with pytest.raises(threading.BrokenBarrierError):
        run_threads(2, rank_main, timeout=0.2)


def test_flat_partitions_cut_inside_a_row_keep_chunks_of_a_useful_size(tmp_path: Path) -> None:
    """A flat ZeRO-1/2 partition boundary at element 770 of a 256 x 256 tensor (row 3,
    column 2): inner chunks do not follow the column cut (that gave 32,768 chunks of 8
    bytes and a shard index larger than the data); the cell across it is exchanged, the
    values round-trip, and a read of a few rows reads a few chunks."""
    full = np.random.default_rng(5).standard_normal((256, 256)).astype(np.float32)
    held = {0: [((0, 3), (0, 256)), ((3, 4), (0, 2))],
            1: [((3, 4), (2, 256)), ((4, 256), (0, 256))]}
    spec = TensorSpec("model/fc.weight", (256, 256), "float32")

    def rank_main(comm: ThreadGroup) -> Any:
        frags = [Fragment(spec.path, box, full[tuple(slice(a, b) for a, b in box)])
                 for box in held[comm.rank]]
        return save_fragments(tmp_path / "ckpt", comm, specs=[spec], fragments=frags,
                                durable=False)

    run_threads(2, rank_main)
    with ucpformat.open(tmp_path / "ckpt") as ckpt:
        array = ckpt[spec.path]
        chunk = array.meta.chunk_shape
        assert chunk is not None and np.prod(chunk) * 4 >= 16 << 10, chunk
        assert np.array_equal(array.read(), full)
        before = ckpt.stats.bytes_read
        assert np.array_equal(array[0:4], full[0:4])
        assert ckpt.stats.bytes_read - before < 64 << 10
