"""Object storage (UCP-1.0-R050 to R054, section 11.3): S3 through fsspec, against moto.

The server runs on 127.0.0.1 with a free port for this module only; every request has
short timeouts and at most two attempts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import ucpformat
from ucpformat.checkpoint.streaming import StreamingWriter
from ucpformat.errors import (
    CheckpointExistsError,
    ConcurrentWriteError,
    IncompleteCheckpointError,
    UCPError,
)
from ucpformat.store import open_store
from ucpformat.store.fsspec_store import FsspecStore
from ucpformat.testing import concurrency, failed_saves, faults
from ucpformat.testing.common import SMALL_CHUNKING, differences, small_state
from ucpformat.testing.s3 import BUCKET, s3_server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    with s3_server() as options:
        yield options


_n = iter(range(10**6))


def _store(s3: dict[str, Any]) -> FsspecStore:
    store = open_store(f"s3://{BUCKET}/ckpt-{os.getpid()}-{next(_n)}", storage_options=s3)
    assert isinstance(store, FsspecStore)
    return store


def _loads_as(store: Any, expected: Any) -> bool:
    with ucpformat.open(store) as ckpt:
        return differences(ckpt.to_dict(), expected) == []


def test_round_trip_and_range_reads(s3: dict[str, Any]) -> None:
    """Save, open, slice, validate --deep through s3:// bit for bit; slices are ranges."""
    store = _store(s3)
    state = small_state(1)
    ucpformat.save(store, state, compression="zstd", hash_algorithm="sha256", **SMALL_CHUNKING)
    assert _loads_as(store, state)
    with ucpformat.open(store) as ckpt:
        ckpt.stats.reset()
        part = ckpt["model/fc.weight"][:4, :8]
        assert part.tobytes() == state["model"]["fc.weight"][:4, :8].tobytes()
        assert ckpt.stats.bytes_read < state["model"]["fc.weight"].nbytes // 4
    report = ucpformat.validate(store, deep=True)
    assert report.valid, report.issues


def test_commit_is_one_put_of_the_root_written_last(s3: dict[str, Any]) -> None:
    """UCP-1.0-R050, UCP-1.0-R054: no rename; the root is one PUT after everything else."""
    trace: list[tuple[str, str]] = []
    store = faults.FaultyStore(_store(s3), trace=trace)
    ucpformat.save(store, small_state(2), **SMALL_CHUNKING)
    puts = [k for op, k in trace if op == "put"]
    assert puts.count("zarr.json") == 1 and puts[-1] == "zarr.json"
    assert trace[-1] == ("delete", "write-in-progress.ucp.json")
    assert {op for op, _ in trace} <= {"put", "delete", "flush"}  # nothing else exists


def _child(s3: dict[str, Any], url: str, kill_at: int, mode: str, delay: float
           ) -> subprocess.Popen[str]:
    endpoint = s3["client_kwargs"]["endpoint_url"]
    return subprocess.Popen(
        [sys.executable, "-m", "ucpformat.testing.s3", endpoint, url, "4", str(kill_at), mode,
         str(delay)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


@pytest.mark.parametrize(
    "kill_at,mode", [(1, "before"), (6, "before"), (-2, "before"), (-2, "after")],
    ids=["prepare", "data", "commit-before", "commit-after"],
)
def test_crash_mid_upload_is_refused_and_retried(
    s3: dict[str, Any], kill_at: int, mode: str
) -> None:
    """UCP-1.0-R051: a writer killed at a step of an S3 save leaves nothing that opens
    (or, killed after the commit, the whole checkpoint); the retried save succeeds."""
    previous = _store(s3)
    ucpformat.save(previous, small_state(3), **SMALL_CHUNKING)
    target = _store(s3)
    if kill_at < 0:  # the commit: count the operations of the same save first
        trace: list[tuple[str, str]] = []
        dry = faults.FaultyStore(_store(s3), trace=trace)
        ucpformat.save(dry, small_state(4), compression="zstd", **SMALL_CHUNKING)
        kill_at = next(i for i, (op, k) in enumerate(trace) if k == "zarr.json")
    proc = _child(s3, target.location, kill_at, mode, 0.0)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, out
    assert _loads_as(previous, small_state(3))
    if mode == "after":
        assert _loads_as(target, small_state(4))
        return
    with pytest.raises(IncompleteCheckpointError) as info:
        ucpformat.open(target)
    assert info.value.rule == "UCP-1.0-R051"
    assert "UCP-1.0-R051" in ucpformat.validate(target).rules()
    # An object store has no locks: a stopped writer's marker cannot be told from a
    # running one's (UCP-1.0-R059), so the retry must say it takes the location over.
    with pytest.raises(ConcurrentWriteError) as busy:
        ucpformat.save(target, small_state(4), compression="zstd", **SMALL_CHUNKING)
    assert busy.value.rule == "UCP-1.0-R059" and "overwrite=True" in str(busy.value)
    ucpformat.save(target, small_state(4), compression="zstd", overwrite=True, **SMALL_CHUNKING)
    assert _loads_as(target, small_state(4))


def test_killed_at_random_times_during_uploads(s3: dict[str, Any]) -> None:
    """UCP-1.0-R051, UCP-1.0-R054: SIGKILL while PUTs are in flight, at random times."""
    rng = np.random.default_rng(0)
    outcomes: Counter[str] = Counter()
    for _ in range(4):
        target = _store(s3)
        proc = _child(s3, target.location, -1, "before", 0.01)
        assert proc.stdout is not None
        proc.stdout.readline()  # "started": imports are done
        time.sleep(float(rng.uniform(0.0, 0.6)))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        try:
            ok = _loads_as(target, small_state(4))
            assert ok, "a committed checkpoint that does not load back"
            outcomes["committed"] += 1
        except UCPError as exc:  # incomplete, or nothing written yet
            assert exc.rule == "UCP-1.0-R051", exc
            outcomes["refused"] += 1
            assert "UCP-1.0-R051" in ucpformat.validate(target).rules()
        ucpformat.save(target, small_state(4), compression="zstd", overwrite=True,
                       **SMALL_CHUNKING)
        assert _loads_as(target, small_state(4))
    assert sum(outcomes.values()) == 4


def test_concurrent_readers_during_a_save(s3: dict[str, Any]) -> None:
    """Readers polling a location while it is written see 'incomplete' (R051) until the
    commit and then the whole checkpoint, never a part; readers of the previous one are
    unaffected (a new location per save, as section 11.3 advises)."""
    previous, target = _store(s3), _store(s3)
    old, new = small_state(5), small_state(6)
    ucpformat.save(previous, old, **SMALL_CHUNKING)
    done = threading.Event()
    seen: Counter[str] = Counter()
    problems: list[str] = []

    def reader() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            finished = done.is_set()
            try:
                with ucpformat.open(target) as ckpt:
                    diffs = differences(ckpt.to_dict(), new)
                seen["complete" if not diffs else "WRONG"] += 1
                if diffs:
                    problems.append(str(diffs[:2]))
            except UCPError as exc:
                seen[f"refused {exc.rule}"] += 1
                if exc.rule != "UCP-1.0-R051":
                    problems.append(str(exc))
            except Exception as exc:
                problems.append(f"{type(exc).__name__}: {exc}")
            try:
                if differences(ucpformat.open(previous).to_dict(), old):
                    problems.append("the previous checkpoint changed")
            except Exception as exc:
                problems.append(f"previous: {type(exc).__name__}: {exc}")
            if finished:
                return

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    slow = faults.FaultyStore(target, delay=0.01)
    ucpformat.save(slow, new, **SMALL_CHUNKING)
    done.set()
    for t in threads:
        t.join(timeout=90)
    assert not problems, problems[:5]
    assert seen["refused UCP-1.0-R051"] > 0 and seen["complete"] > 0, seen


def test_one_writer_at_a_time_on_an_object_store(s3: dict[str, Any]) -> None:
    """UCP-1.0-R059 on S3 (no locks): the marker is created with a conditional PUT, so a
    second writer is refused; with overwrite=True it takes the location over, and the
    first, whose token is gone from the marker, commits nothing."""
    store = _store(s3)
    w = np.arange(12, dtype=np.float32)
    first = StreamingWriter(store)
    first.declare("model/w", w.shape, w.dtype)
    first.write("model/w", w)
    second = open_store(store.location, storage_options=s3)
    with pytest.raises(ConcurrentWriteError) as info:
        ucpformat.save(second, {"model": {"w": w + 1}})
    assert info.value.rule == "UCP-1.0-R059" and "overwrite=True" in str(info.value)
    ucpformat.save(second, {"model": {"w": w + 1}}, overwrite=True)
    with pytest.raises(ConcurrentWriteError) as info:
        first.commit()
    assert "took this location over" in str(info.value)
    with ucpformat.open(store) as ckpt:
        assert np.array_equal(ckpt["model/w"].read(), w + 1)


def test_objects_are_created_never_replaced(s3: dict[str, Any]) -> None:
    """UCP-1.0-R059: a stored object another writer put there first fails the PUT
    (If-None-Match), instead of being replaced by this save's."""
    store = _store(s3)
    w = np.ones(4, np.float32)
    writer = StreamingWriter(store)
    writer.declare("model/w", w.shape, w.dtype)
    store.put("model/w/c/0", [b"another writer's"])
    with pytest.raises(ConcurrentWriteError):
        writer.write("model/w", w)
    assert store.get("model/w/c/0") == b"another writer's"


def test_a_stray_key_refuses_the_save_and_keeps_the_checkpoint(s3: dict[str, Any]) -> None:
    """UCP-1.0-R049: a key with ``..`` was listed normalised (another key), the save
    un-committed the checkpoint and then failed on it at every retry."""
    store = _store(s3)
    old, new = small_state(7), small_state(8)
    ucpformat.save(store, old, **SMALL_CHUNKING)
    stray = f"{store.root}/model/../x"
    store.fs.pipe_file(stray, b"someone else's")
    with pytest.raises(CheckpointExistsError) as info:
        ucpformat.save(store, new, overwrite=True, **SMALL_CHUNKING)
    assert info.value.rule == "UCP-1.0-R049" and "model/../x" in str(info.value)
    assert _loads_as(store, old)
    store.fs.rm_file(stray)
    ucpformat.save(store, new, overwrite=True, **SMALL_CHUNKING)
    assert _loads_as(store, new)


def test_concurrency_and_stray_harnesses_on_s3(s3: dict[str, Any]) -> None:
    """The quick modes of the concurrent-writer and stray-file harnesses against S3."""
    figures = concurrency.run(3, seed=2, modes=("s3",), s3_options=s3)
    assert figures.as_dict()["mixed checkpoints"] == 0 and not figures.failures, (
        figures.failures)
    strays = failed_saves.run(2, seed=3, kinds=("s3-stray",), s3_options=s3)
    assert not strays.failures, strays.failures


def test_keys_cannot_leave_the_prefix(s3: dict[str, Any]) -> None:
    """UCP-1.0-R091 on object stores: keys are checked as for files."""
    store = _store(s3)
    for key in ["../other/zarr.json", "/zarr.json", "a//b", "a/./b"]:
        with pytest.raises(UCPError):
            store.put(key, [b"x"])
    with pytest.raises(UCPError):
        FsspecStore("s3://", storage_options=s3)


@pytest.mark.parametrize("serialised", [True, False])
def test_the_test_server_lets_one_of_two_conditional_puts_win(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch, serialised: bool
) -> None:
    """Spec section 11.4 rests on S3's conditional PUT: of two ``If-None-Match: *`` PUTs of
    one key at once, one succeeds and the other is refused. moto checks and stores in two
    steps; with its existence check slowed so that both requests pass it, the harness's
    server (``serialise_object_writes``) still lets exactly one win, and moto without it
    lets both "win" (the later object replaces the first: a writer displaced without
    knowing it, which mixed two writers' checkpoints in the concurrency harness)."""
    from moto.s3.models import S3Backend
    from moto.s3.responses import S3Response

    if not serialised:  # moto's own PUT, not one at a time
        put_handler = S3Response._key_response_put
        monkeypatch.setattr(S3Response, "_key_response_put", put_handler.__wrapped__)
    real_get = S3Backend.get_object
    both_checked = threading.Barrier(2, timeout=2)

    def slow_get(self: Any, bucket: str, key: str, *args: Any, **kwargs: Any) -> Any:
        found = real_get(self, bucket, key, *args, **kwargs)
        if key.endswith("/race"):
            with contextlib.suppress(threading.BrokenBarrierError):
                both_checked.wait()  # both requests checked before either stores
        return found

    monkeypatch.setattr(S3Backend, "get_object", slow_get)
    store = _store(s3)
    outcomes: list[str] = []

    def put(body: bytes) -> None:
        try:
            store.create("race", [body])
        except FileExistsError:
            outcomes.append("refused")
        else:
            outcomes.append("created")

    threads = [threading.Thread(target=put, args=(b,)) for b in (b"first", b"second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = ["created", "refused"] if serialised else ["created", "created"]
    assert sorted(outcomes) == expected
