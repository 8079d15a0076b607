"""The staging path of saves (ucpformat.torch.staging), exercised on the CPU.

CPU tensors are staged here with ``Staging(cpu=True)``: the same pool, copy thread and
ordering that CUDA tensors take, minus the device. The CUDA-only checks are in
test_cuda.py.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ucpformat  # noqa: E402
from tests.helpers import FailingCopier  # noqa: E402
from tests.torch import dist_workers as w  # noqa: E402
from ucpformat.errors import ResourceLimitError, UCPError, WriteError  # noqa: E402
from ucpformat.store import LocalStore  # noqa: E402
from ucpformat.torch.async_save import AsyncSaver  # noqa: E402
from ucpformat.torch.dcp import UCPWriter  # noqa: E402
from ucpformat.torch.distributed import save_distributed  # noqa: E402
from ucpformat.torch.staging import (  # noqa: E402
    ALIGN_BYTES,
    HostBufferPool,
    Staging,
)
from ucpformat.torch.state import load_state_dict, save  # noqa: E402

pytestmark = pytest.mark.torch

WAIT_S = 60  # a missing event fails the test after this, instead of hanging it


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def _model(width: int = 64, layers: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


class Events:
    """A recorder: every (event, key) in order, and a way to wait for one."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self._cond = threading.Condition()

    def __call__(self, event: str, key: str) -> None:
        with self._cond:
            self.log.append((event, key))
            self._cond.notify_all()

    def wait_for(self, event: str, key: str) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: (event, key) in self.log, timeout=WAIT_S)

    def index(self, event: str, key: str) -> int:
        return self.log.index((event, key))

    def keys(self, event: str) -> list[str]:
        return [k for e, k in self.log if e == event]


# -- the pool -----------------------------------------------------------------------------


def test_pool_never_holds_more_than_its_bound_under_concurrent_use() -> None:
    cap = 16 * ALIGN_BYTES
    pool = HostBufferPool(cap, pin=False)
    rng = random.Random(0)
    sizes = [rng.randrange(1, 5 * ALIGN_BYTES) for _ in range(400)]
    errors: list[BaseException] = []

    def worker(chunk: list[int]) -> None:
        try:
            for n in chunk:
                buf = pool.acquire(n)
                assert buf.numel() >= n
                assert pool.stats.allocated_bytes <= cap
                pool.release(buf)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(sizes[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert 0 < pool.stats.peak_allocated_bytes <= cap
    assert pool.stats.peak_in_use_bytes <= cap
    assert pool.stats.in_use_bytes == 0
    assert pool.stats.reuses > 0


def test_pool_stages_a_larger_tensor_alone_and_frees_it() -> None:
    pool = HostBufferPool(4 * ALIGN_BYTES, pin=False)
    small = pool.acquire(ALIGN_BYTES)
    with pytest.raises(ResourceLimitError):
        pool.acquire(10 * ALIGN_BYTES, wait=False)  # not alone: it must wait
    pool.release(small)
    big = pool.acquire(10 * ALIGN_BYTES)  # alone: allowed, over the bound
    assert pool.stats.allocated_bytes == 10 * ALIGN_BYTES
    pool.release(big)
    assert pool.stats.allocated_bytes == 0  # freed: the pool is back under its bound


# -- the single-process save --------------------------------------------------------------


def test_save_stays_within_the_pool_and_reuses_buffers_across_tensors(
    tmp_path: Path,
) -> None:
    model = _model(width=128, layers=8)  # 8 weights of 64 KiB, 8 biases
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    pool = HostBufferPool(3 * 64 * 1024, pin=False)  # well under the state
    staging = Staging(pool=pool, cpu=True)
    for name in ("a", "b"):
        save(tmp_path / name, model=model, staging=staging)
        assert pool.stats.peak_allocated_bytes <= pool.capacity_bytes < state_bytes
        assert pool.stats.peak_in_use_bytes <= pool.capacity_bytes
        assert pool.stats.in_use_bytes == 0
    assert pool.stats.reuses > 0  # across tensors
    assert pool.stats.allocations < 2 * len(model.state_dict())
    for name in ("a", "b"):
        got = load_state_dict(tmp_path / name)
        for k, v in model.state_dict().items():
            assert _raw(got[k]) == _raw(v), k


def test_a_second_save_reuses_the_buffers_of_the_first(tmp_path: Path) -> None:
    model = _model(width=128, layers=4)
    pool = HostBufferPool(1 << 22, pin=False)  # room for the whole state
    staging = Staging(pool=pool, cpu=True)
    save(tmp_path / "a", model=model, staging=staging)
    allocated, reused = pool.stats.allocations, pool.stats.reuses
    assert allocated > 0
    save(tmp_path / "b", model=model, staging=staging)
    # the first weight and the first bias of the second save find the first save's
    # buffers idle (more may be needed if more copies happen to be in flight at once)
    assert pool.stats.reuses - reused >= 2
    assert pool.stats.allocations - allocated < len(model.state_dict())


class _GatedStore(LocalStore):
    """Holds the write of tensor ``i``'s data until the copy of tensor ``i + 1`` started."""

    def __init__(self, root: Path, events: Events, order: list[str]) -> None:
        super().__init__(str(root), durable=False)
        self.events = events
        self.order = order
        self.overlapped: list[str] = []

    def _gate(self, key: str) -> None:
        for i, path in enumerate(self.order[:-1]):
            if key.startswith(path + "/") and not key.endswith("zarr.json") and \
                    self.events.wait_for("copy-start", self.order[i + 1]):
                self.overlapped.append(path)

    def put(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        self._gate(key)
        return super().put(key, buffers, atomic=atomic)

    def create(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        self._gate(key)  # stored objects are created (never replacing one)
        return super().create(key, buffers, atomic=atomic)


def test_the_next_tensor_is_copied_while_the_previous_one_is_written(tmp_path: Path) -> None:
    model = _model(width=64, layers=4)
    order = [f"model/{k}" for k in model.state_dict()]
    events = Events()
    store = _GatedStore(tmp_path / "ckpt", events, order)
    save(store, model=model,
         staging=Staging(pool=HostBufferPool(1 << 20, pin=False), cpu=True, recorder=events))
    # every tensor but the last was written only once the next one's copy had started
    assert sorted(set(store.overlapped)) == sorted(order[:-1])
    for i, path in enumerate(order[:-1]):
        assert events.index("copy-start", order[i + 1]) < events.index("release", path)
    assert events.keys("copy-start") == order  # copied in the writer's order
    got = load_state_dict(tmp_path / "ckpt")
    assert all(_raw(got[k]) == _raw(v) for k, v in model.state_dict().items())


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
          torch.float8_e4m3fn, torch.float8_e5m2]


def _every_dtype() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    out: dict[str, torch.Tensor] = {}
    for dt in DTYPES:
        raw = torch.randint(0, 256, (7 * 5 * torch.empty(0, dtype=dt).element_size(),),
                            dtype=torch.uint8, generator=gen)
        t = raw.view(dt).reshape(7, 5) if dt != torch.bool else (raw[:35] & 1).bool().reshape(7, 5)
        out[str(dt).removeprefix("torch.")] = t
    out["transposed"] = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    out["scalar"] = torch.tensor(2.5)
    return out


def test_every_dtype_round_trips_bit_exactly_through_staging(tmp_path: Path) -> None:
    tensors = _every_dtype()
    pool = HostBufferPool(2 * ALIGN_BYTES, pin=False)
    save(tmp_path / "ckpt", extra={"all": tensors}, staging=Staging(pool=pool, cpu=True))
    got = load_state_dict(tmp_path / "ckpt", prefix="training/all")
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert _raw(got[k]) == _raw(v.contiguous()), k
    assert pool.stats.peak_allocated_bytes <= 2 * ALIGN_BYTES


def test_a_failed_copy_fails_the_save_and_commits_nothing(tmp_path: Path) -> None:
    model = _model()
    pool = HostBufferPool(1 << 20, pin=False)
    with pytest.raises(WriteError, match="device lost") as info:
        save(tmp_path / "ckpt", model=model,
             staging=Staging(pool=pool, cpu=True, copier=FailingCopier(3)))
    assert info.value.tensor == "model/1.weight"  # the third tensor, named
    assert not (tmp_path / "ckpt" / "zarr.json").exists()
    with pytest.raises(UCPError):
        ucpformat.open_checkpoint(tmp_path / "ckpt")
    assert pool.stats.in_use_bytes == 0  # every buffer came back


class _FailingStore(LocalStore):
    def put(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        if key.startswith("model/2.weight/"):
            raise OSError(28, "No space left on device")
        return super().put(key, buffers, atomic=atomic)

    def create(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        if key.startswith("model/2.weight/"):
            raise OSError(28, "No space left on device")
        return super().create(key, buffers, atomic=atomic)


def test_a_failed_write_stops_the_copies_and_commits_nothing(tmp_path: Path) -> None:
    model = _model(layers=8)
    pool = HostBufferPool(1 << 20, pin=False)
    events = Events()
    before = threading.active_count()
    with pytest.raises(WriteError, match="No space"):
        save(_FailingStore(str(tmp_path / "ckpt"), durable=False), model=model,
             staging=Staging(pool=pool, cpu=True, recorder=events))
    assert not (tmp_path / "ckpt" / "zarr.json").exists()
    assert pool.stats.in_use_bytes == 0
    deadline = time.monotonic() + WAIT_S
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before  # the copy thread ended


# -- the distributed save and the DCP plugin ------------------------------------------------


def test_save_distributed_stages_through_a_bounded_pool(tmp_path: Path) -> None:
    model = _model(width=128, layers=6)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 128)).sum().backward()
    opt.step()
    pool = HostBufferPool(2 * 64 * 1024 + 4 * ALIGN_BYTES, pin=False)
    events = Events()
    save_distributed(tmp_path / "ckpt", model=model, optimizer=opt, step=1,
                     staging=Staging(pool=pool, cpu=True, recorder=events))
    assert pool.stats.peak_allocated_bytes <= pool.capacity_bytes
    assert pool.stats.in_use_bytes == 0 and pool.stats.reuses > 0
    assert len(events.keys("release")) == len(events.keys("copy-start")) > 12
    ck = ucpformat.open_checkpoint(tmp_path / "ckpt")
    for k, v in model.state_dict().items():
        assert ck.tensor("model", k).read().tobytes() == _raw(v), k
    for p, name in zip(model.parameters(), dict(model.named_parameters()), strict=True):
        got = ck.tensor("optimizer", "state", name, "exp_avg").read().tobytes()
        assert got == _raw(opt.state[p]["exp_avg"])


def test_dcp_plugin_stages_through_a_bounded_pool(tmp_path: Path) -> None:
    model = _model(width=128, layers=4)
    pool = HostBufferPool(64 * 1024 + 4 * ALIGN_BYTES, pin=False)
    events = Events()
    dcp.save({"model": model.state_dict()}, storage_writer=UCPWriter(
        tmp_path / "ckpt", durable=False,
        staging=Staging(pool=pool, cpu=True, recorder=events)))
    assert pool.stats.peak_allocated_bytes <= pool.capacity_bytes
    assert pool.stats.in_use_bytes == 0
    assert len(events.keys("copy-start")) == len(model.state_dict())
    ck = ucpformat.open_checkpoint(tmp_path / "ckpt")
    for k, v in model.state_dict().items():
        assert ck.tensor("model", k).read().tobytes() == _raw(v), k


# -- asynchronous snapshots -----------------------------------------------------------------


class _DeferredCopier:
    """Simulates a device: each copy runs later on a thread, done when its event is set;
    ``guard`` is where a device stream would wait (here the host waits: no stream)."""

    def __init__(self, events: Events) -> None:
        self.events = events

    def begin(self, tensors: Any) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        done = threading.Event()
        key = f"copy{id(dst)}"

        def run() -> None:
            time.sleep(0.002)
            dst.copy_(src)
            self.events("copy-end", key)
            done.set()

        threading.Thread(target=run, daemon=True).start()
        return (done, key)

    def wait(self, done: Any) -> None:
        assert done[0].wait(WAIT_S)

    def guard(self, done: Any) -> None:
        assert done[0].wait(WAIT_S)
        self.events("guarded", done[1])


def test_async_snapshot_releases_each_tensor_only_after_its_copy(tmp_path: Path) -> None:
    model = w.build("plain")
    opt = w.make_optimizer(model)
    w.train(model, opt, 1)
    events = Events()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with AsyncSaver(copier=_DeferredCopier(events), recorder=events) as saver:
        future = saver.save(tmp_path / "a", model=model, optimizer=opt, step=1)
        events("returned", "save")
        with torch.no_grad():  # training modifies every parameter right away
            for p in model.parameters():
                p.add_(1.0)
        staged = saver.staging_bytes
        future.result()
        copies = [k for e, k in events.log if e == "copy-end"]
        assert copies and len(copies) == len(events.keys("guarded"))
        for key in copies:  # guarded only after its copy ended, all before the return
            assert events.index("copy-end", key) < events.index("guarded", key) \
                < events.index("returned", "save")
        saver.save(tmp_path / "b", model=model, optimizer=opt, step=2).result()
        assert saver.staging_bytes == staged  # the same buffers, reused
        assert saver.staging_pool.stats.reuses > 0
    ck = ucpformat.open_checkpoint(tmp_path / "a")
    for k, v in before.items():
        assert ck.tensor("model", k).read().tobytes() == _raw(v), k


def test_async_snapshot_larger_than_a_bounded_pool_is_refused(tmp_path: Path) -> None:
    model = w.build("plain")
    with AsyncSaver(pool=HostBufferPool(ALIGN_BYTES, pin=False)) as saver:
        with pytest.raises(ResourceLimitError, match="snapshot needs"):
            saver.save(tmp_path / "a", model=model)
        assert saver.staging_pool.stats.in_use_bytes == 0
    assert not (tmp_path / "a" / "zarr.json").exists()


def test_staging_disabled_or_cpu_tensors_write_from_their_own_memory(tmp_path: Path) -> None:
    model = _model()
    pool = HostBufferPool(1 << 20, pin=False)
    save(tmp_path / "a", model=model, staging=Staging(pool=pool))  # CPU: not staged
    save(tmp_path / "b", model=model, staging=Staging(pool=pool, cpu=True, enabled=False))
    assert pool.stats.allocations == 0
    a, b = load_state_dict(tmp_path / "a"), load_state_dict(tmp_path / "b")
    assert all(_raw(a[k]) == _raw(v) == _raw(b[k]) for k, v in model.state_dict().items())


def test_numpy_of_a_staged_value_is_never_an_alias_of_a_live_tensor(tmp_path: Path) -> None:
    t = torch.arange(10, dtype=torch.float32)
    pool = HostBufferPool(1 << 20, pin=False)
    stager = Staging(pool=pool, cpu=True).stager({"x": t})
    arr = stager.get("x")
    t.add_(1)
    assert np.array_equal(arr, np.arange(10, dtype=np.float32))
    stager.release("x")
    stager.stop()


# -- loads to a device ----------------------------------------------------------------------


class _GatedCopier(_DeferredCopier):
    """A simulated device whose copy of batch k completes only once batch k + 1 is being
    read (the last batch at once)."""

    def __init__(self, events: Events, batches: int) -> None:
        super().__init__(events)
        self.batches = batches
        self.batch = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        done = threading.Event()
        nxt = self.batch + 1
        events = self.events
        last = self.batch + 1 >= self.batches

        def run() -> None:
            if not last:
                events.wait_for("read", str(nxt))
            dst.copy_(src)
            done.set()

        threading.Thread(target=run, daemon=True).start()
        return (done, "")


def test_reads_for_a_device_overlap_copies_within_the_pool(tmp_path: Path) -> None:
    from ucpformat.torch.reads import DeviceStaging, TensorRead, read_tensors

    model = _model(width=128, layers=6)
    save(tmp_path / "ckpt", model=model)
    ck = ucpformat.open_checkpoint(tmp_path / "ckpt")
    paths = [f"model/{k}" for k in model.state_dict()]
    pool = HostBufferPool(2 * (64 * 1024 + ALIGN_BYTES), pin=False)  # batches of a weight
    events = Events()

    class _Copier(_GatedCopier):
        def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
            self.batch = int(events.keys("read")[-1])
            return super().copy(dst, src)

    copier = _Copier(events, batches=6)
    got = read_tensors(ck, [TensorRead(p, device="cpu") for p in paths],
                       staging=DeviceStaging(pool=pool, cpu=True, copier=copier,
                                             recorder=events)).tensors
    for t, v in zip(got, model.state_dict().values(), strict=True):
        assert _raw(t) == _raw(v)
    reads = events.keys("read")
    assert len(reads) == 6  # weight + bias per batch
    for k in range(len(reads) - 1):  # batch k's copy ended after batch k + 1 began its read
        assert events.index("read", str(k + 1)) < events.index("copied", str(k))
    assert pool.stats.peak_allocated_bytes <= pool.capacity_bytes
    assert pool.stats.in_use_bytes == 0 and pool.stats.reuses > 0


def _dcp_checkpoint(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model = _model(width=128, layers=4)
    dcp.save({"model": model.state_dict()}, storage_writer=UCPWriter(tmp_path / "ckpt",
                                                                     durable=False))
    return model, tmp_path / "ckpt"


def test_dcp_load_reads_straight_into_cpu_targets(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import ucpformat.torch.dcp_reader as plugin
    from ucpformat.torch.dcp import UCPReader

    model, path = _dcp_checkpoint(tmp_path)
    targets = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    pointers = {k: v.data_ptr() for k, v in targets.items()}

    def no_copies(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a tensor was read into new memory and copied")

    monkeypatch.setattr(plugin, "from_numpy", no_copies)
    dcp.load({"model": targets}, storage_reader=UCPReader(path))
    for k, v in model.state_dict().items():
        assert targets[k].data_ptr() == pointers[k] and _raw(targets[k]) == _raw(v), k


def test_dcp_load_to_a_device_goes_through_the_pool(tmp_path: Path) -> None:
    from ucpformat.torch.dcp import UCPReader
    from ucpformat.torch.reads import DeviceStaging

    model, path = _dcp_checkpoint(tmp_path)
    targets = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    pool = HostBufferPool(2 * 64 * 1024 + 2 * ALIGN_BYTES, pin=False)
    events = Events()
    dcp.load({"model": targets}, storage_reader=UCPReader(
        path, workers=1, staging=DeviceStaging(pool=pool, cpu=True, recorder=events)))
    for k, v in model.state_dict().items():
        assert _raw(targets[k]) == _raw(v), k
    assert pool.stats.allocations > 0 and pool.stats.in_use_bytes == 0
    assert pool.stats.peak_allocated_bytes <= pool.capacity_bytes
    assert events.keys("copied")  # batches retired once copied


def test_the_pipeline_exchange_and_write_of_staged_ranks(tmp_path: Path) -> None:
    """Two ranks (threads) hold rows 0-3 and 3-8 of one tensor; shards coarser than that
    make rank 1 send its cells to the owner: the exchange takes them from the staging
    area (copied when asked, released after packing), the write step from the scheduled
    copies; every buffer returns."""
    from ucpformat.distributed import TensorSpec
    from ucpformat.distributed import save_fragments as core_save
    from ucpformat.distributed.comm import run_threads
    from ucpformat.layout.boxes import Piece
    from ucpformat.torch.distributed import StagedFragments

    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    rows = [(0, 3), (3, 8)]
    pools = [HostBufferPool(1 << 20, pin=False) for _ in rows]
    logs = [Events() for _ in rows]

    def rank(comm: Any) -> Any:
        a, b = rows[comm.rank]
        local = full[a:b].clone()
        piece = Piece(((0, b - a), (0, 6)), ((a, b), (0, 6)))
        source = StagedFragments([("model/w", local, (piece,))],
                                 Staging(pool=pools[comm.rank], cpu=True,
                                         recorder=logs[comm.rank]))
        try:
            return core_save(tmp_path / "ckpt", comm,
                             specs=[TensorSpec("model/w", (8, 6), "float32")],
                             fragments=source, min_shard_bytes=1 << 20)
        finally:
            source.stop()

    results = run_threads(2, rank, timeout=WAIT_S)
    assert sum(r.bytes_received_here for r in results) > 0  # cells were exchanged
    got = ucpformat.open_checkpoint(tmp_path / "ckpt").tensor("model", "w").read()
    assert got.tobytes() == _raw(full)
    for pool, log in zip(pools, logs, strict=True):
        assert pool.stats.in_use_bytes == 0
        assert len(log.keys("release")) == len(log.keys("copy-start")) >= 1


def test_staged_targets_on_a_device_are_filled_through_the_pool_at_apply(
        tmp_path: Path) -> None:
    """Staged (the default), nothing changes before apply(); apply() then copies each
    target's bytes into pool buffers and on to the device in batches within the bound,
    and a target of another type takes a plain (converting) copy."""
    from ucpformat.torch.reads import DeviceStaging, TensorRead, read_tensors

    model = _model(width=128, layers=6)
    save(tmp_path / "ckpt", model=model)
    ck = ucpformat.open_checkpoint(tmp_path / "ckpt")
    state = model.state_dict()
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    targets["0.bias"] = torch.zeros(128, dtype=torch.float64)  # another type: not pooled
    pool = HostBufferPool(2 * (64 * 1024 + ALIGN_BYTES), pin=False)  # batches of a weight
    events = Events()
    staged = read_tensors(ck, [TensorRead(f"model/{k}", target=t) for k, t in targets.items()],
                          staging=DeviceStaging(pool=pool, cpu=True,
                                                copier=_DeferredCopier(events),
                                                recorder=events))
    assert all(not t.any() for t in targets.values())  # staged: nothing changed yet
    assert pool.stats.allocations == 0  # no pinned memory held between read and apply
    staged.apply()
    for k, v in state.items():
        assert _raw(targets[k].to(v.dtype)) == _raw(v), k
    assert events.keys("copied") == [f"apply {i}" for i in range(6)]  # weight + bias each
    assert len(events.keys("copy-end")) == len(state) - 1  # the float64 bias: plain copy
    assert pool.stats.peak_allocated_bytes <= pool.capacity_bytes
    assert pool.stats.in_use_bytes == 0 and pool.stats.reuses > 0


@pytest.mark.parametrize("src", [
    torch.randn(5, 3).bfloat16(), torch.tensor(3.5), torch.tensor([True, False]),
    torch.randn(4, requires_grad=True), torch.empty(0),
    torch.randint(-9, 9, (3, 2), dtype=torch.int64), torch.randn(2, 2).to(torch.float8_e4m3fn),
], ids=["bf16", "0-d", "bool", "requires-grad", "empty", "int64", "float8"])
def test_host_copy_copies_every_byte(src: torch.Tensor) -> None:
    """The snapshot's host-to-host copy (numpy's memory copy of the tensors' bytes) for
    types numpy has no name for, 0-d and empty tensors, and tensors that need grad."""
    from ucpformat.torch.staging import host_copy

    dst = torch.zeros_like(src, requires_grad=False)
    host_copy(dst, src)
    assert dst.dtype == src.dtype and dst.shape == src.shape
    assert bytes(dst.reshape(-1).view(torch.uint8).tolist()) == \
        bytes(src.detach().reshape(-1).view(torch.uint8).tolist())


@pytest.mark.parametrize("way", ["new tensors", "staged targets", "dcp"])
def test_a_batch_that_takes_larger_idle_buffers_ends_where_the_pool_is_full(
        tmp_path: Path, way: str) -> None:
    """A pool's idle buffers may be larger than what is asked (a load of large tensors
    before): a batch that takes them can fill the pool before its nominal half. The
    batch then ends there and the next one waits for its copies, instead of failing the
    load (seen on an H200: every 8 GiB load to CUDA raised ResourceLimitError)."""
    from ucpformat.torch.dcp_reader import UCPReader
    from ucpformat.torch.reads import DeviceStaging, TensorRead, read_tensors

    mib = 1 << 20
    state = {"big0": torch.randn(mib), "big1": torch.randn(mib),  # 4 MiB each
             "a": torch.randn(mib * 3 // 8), "b": torch.randn(mib * 3 // 8),  # 1.5 MiB
             "c": torch.randn(mib // 4)}  # 1 MiB
    dcp.save(state, storage_writer=UCPWriter(tmp_path / "ckpt", durable=False))
    ck = ucpformat.open_checkpoint(tmp_path / "ckpt")
    pool = HostBufferPool(8 * mib, pin=False)  # batches of 4 MiB
    how = DeviceStaging(pool=pool, cpu=True)
    read_tensors(ck, [TensorRead(f"model/{k}", device="cpu") for k in ("big0", "big1")],
                 staging=how)
    assert pool.stats.allocated_bytes == 8 * mib  # two idle 4 MiB buffers
    small = ("a", "b", "c")  # 4 MiB in all: one nominal batch, 1.5 + 1.5 take both 4 MiB
    if way == "new tensors":
        reads = [TensorRead(f"model/{k}", device="cpu") for k in small]
        got = dict(zip(small, read_tensors(ck, reads, staging=how).tensors, strict=True))
    elif way == "staged targets":
        got = {k: torch.zeros_like(state[k]) for k in small}
        read_tensors(ck, [TensorRead(f"model/{k}", target=t)
                          for k, t in got.items()],
                     staging=how).apply()
    else:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        resolved: list[str] = []

        class Counting(DefaultLoadPlanner):  # a planner may allocate in resolve_tensor
            def resolve_tensor(self, read_item: Any) -> torch.Tensor:
                resolved.append(read_item.dest_index.fqn)
                return super().resolve_tensor(read_item)

        got = {k: torch.zeros_like(state[k]) for k in small}
        dcp.load(got, storage_reader=UCPReader(tmp_path / "ckpt", workers=1, staging=how),
                 planner=Counting())
        assert sorted(resolved) == sorted(small)  # once each, the window cut or not
    for k in small:
        assert torch.equal(got[k], state[k]), k
    assert pool.stats.peak_allocated_bytes <= pool.capacity_bytes
    assert pool.stats.in_use_bytes == 0


def test_a_failed_dcp_read_gives_buffers_back_only_after_the_other_reads_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One read of a window fails while another still writes into its pool buffer: the
    buffers return to the (shared) pool only once that write has ended, so no other load
    can be handed a buffer that is still being written."""
    from ucpformat.checkpoint.reader import Tensor
    from ucpformat.errors import ChecksumError
    from ucpformat.torch.dcp_reader import UCPReader
    from ucpformat.torch.reads import DeviceStaging

    state = {"fails": torch.randn(4096), "slow": torch.randn(4096)}
    dcp.save(state, storage_writer=UCPWriter(tmp_path / "ckpt", durable=False))
    timeline: list[str] = []
    read_region = Tensor.read_region

    slow_started = threading.Event()

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.path.endswith("fails"):
            assert slow_started.wait(10)
            raise ChecksumError("a damaged chunk", path=self.path)
        slow_started.set()
        time.sleep(0.3)  # still writing into its buffer when the other read has failed
        out = read_region(self, *args, **kwargs)
        timeline.append("slow read ended")
        return out

    class Recording(HostBufferPool):
        def release(self, buf: torch.Tensor) -> None:
            timeline.append("buffer released")
            super().release(buf)

    monkeypatch.setattr(Tensor, "read_region", patched)
    pool = Recording(None, pin=False)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as failed:
        dcp.load(got, storage_reader=UCPReader(tmp_path / "ckpt", workers=2,
                                               staging=DeviceStaging(pool=pool, cpu=True)))
    (rank_failure,) = failed.value.failures.values()
    assert "a damaged chunk" in str(rank_failure)
    assert timeline[0] == "slow read ended" and timeline.count("buffer released") == 2
    assert pool.stats.in_use_bytes == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64,
                                   torch.complex128, torch.bool, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(), (3,), (2, 4)])
def test_typed_view_is_the_first_bytes_of_the_buffer(dtype: Any, shape: tuple[int, ...]) -> None:
    from ucpformat.torch.staging import typed_view

    storage = torch.arange(256, dtype=torch.uint8)
    like = torch.empty(shape, dtype=dtype)
    n = like.numel() * like.element_size()
    transposed = torch.empty(shape[::-1], dtype=dtype).mT if len(shape) == 2 else like
    for start, of in ((0, like), (16, like), (0, transposed)):  # a pool buffer; one further
        buf = storage[start:]  # into its storage; a target that is not contiguous
        view = typed_view(buf, of)
        assert view.shape == like.shape and view.dtype == dtype and view.is_contiguous()
        assert view.data_ptr() == buf.data_ptr()  # a view, not a copy
        assert view.reshape(-1).view(torch.uint8).tolist() == buf[:n].tolist()
    with pytest.raises(ValueError, match="cannot hold"):  # never past the buffer's end
        typed_view(storage[:n - 1], like)
