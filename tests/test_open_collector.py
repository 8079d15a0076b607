"""Opening a checkpoint pauses the cyclic garbage collector from the parse of the root
until the parsed document is let go (it holds no cycle, and a collection while it lived
traversed all of it), never during the read; pauses nest and overlap across threads."""

from __future__ import annotations

import gc
import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.checkpoint.metadata import gc_paused
from ucpformat.errors import FormatError
from ucpformat.store import LocalStore


def containers(value: Any) -> int:
    """The lists and objects of a parsed JSON document."""
    if isinstance(value, dict):
        return 1 + sum(containers(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(containers(v) for v in value)
    return 0


def test_no_collection_traverses_the_parsed_root_while_a_checkpoint_opens(tmp_path: Path) -> None:
    tensors = {f"layer{i}": np.full(4, i, dtype=np.float32) for i in range(400)}
    ucpformat.save(tmp_path / "c", {"model": tensors}, durable=False)
    young: list[int] = []  # container objects made since the last collection, at each

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 0:
            young.append(gc.get_count()[0])

    gc.collect()
    threshold = gc.get_threshold()
    gc.set_threshold(100)  # a collection every 100 allocations, were it running
    gc.callbacks.append(record)
    try:
        ckpt = ucpformat.open_checkpoint(tmp_path / "c")
        during = list(young)
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*threshold)
    # resumed while the parsed root lived, the collector would start with all of its
    # containers young (and the arrays' metadata besides); let go first, with the
    # metadata only
    document = json.loads((tmp_path / "c" / "zarr.json").read_bytes())
    assert max(during, default=0) < containers(document), during
    assert gc.isenabled()
    assert len(ckpt.arrays) == 400
    ckpt.close()


def test_the_collector_runs_again_after_a_refused_open(tmp_path: Path) -> None:
    ucpformat.save(tmp_path / "c", {"model": {"w": np.zeros(3, np.float32)}}, durable=False)
    root = tmp_path / "c" / "zarr.json"
    root.write_bytes(root.read_bytes().replace(b'"zarr_format":3', b'"zarr_format":3,'
                                               b'"zarr_format":3', 1))
    with pytest.raises(FormatError) as info:
        ucpformat.open_checkpoint(tmp_path / "c")
    assert info.value.rule == "UCP-1.0-R001" and "duplicate key" in str(info.value)
    assert gc.isenabled()


def test_the_collector_runs_while_the_root_is_read(tmp_path: Path) -> None:
    ucpformat.save(tmp_path / "c", {"model": {"w": np.zeros(3, np.float32)}}, durable=False)
    seen: list[bool] = []

    class Watched(LocalStore):  # (a store may read over a network: no pause meanwhile)
        def get_range(self, key: str, offset: int, length: int) -> bytes | None:
            seen.append(gc.isenabled())
            return super().get_range(key, offset, length)

    ckpt = ucpformat.open_checkpoint(Watched(str(tmp_path / "c")))
    assert seen and all(seen)
    assert list(ckpt.arrays) == ["model/w"]


def test_pauses_overlapping_in_threads_leave_the_collector_running() -> None:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between every few instructions
    errors: list[BaseException] = []

    def pause_often() -> None:
        try:
            for _ in range(2000):
                with gc_paused():
                    assert not gc.isenabled()
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=pause_often) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # an inner pause's end leaves the outer one paused
    assert gc.isenabled()
