"""AsyncSaver(writer="process"): the write runs in a child process over shared memory.

Bit-equal round trips; a failure in the child (a write that fails, the child killed)
raised by ``wait()`` with the previous checkpoint intact; what cannot travel to the child
as JSON refused before it hears of it; nothing left behind after ``close()`` (no
process, no shared memory); the CheckpointManager's async saves.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from tests.torch import dist_workers as w  # noqa: E402
from ucpformat.checkpoint.manager import CheckpointManager  # noqa: E402
from ucpformat.errors import InvalidValueError, UCPError, WriteError  # noqa: E402
from ucpformat.store import LocalStore  # noqa: E402
from ucpformat.torch.async_save import AsyncSaver, close_async, save_async  # noqa: E402
from ucpformat.torch.writer_process import (  # noqa: E402
    SharedArena,
    WriterProcess,
    WriterProcessError,
)

pytestmark = pytest.mark.torch


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def _same_model(path: Path, state: dict[str, torch.Tensor]) -> bool:
    ck = ucpformat.open_checkpoint(path)
    return all(ck.tensor("model", k).read().tobytes() == _raw(v) for k, v in state.items())


def _memfds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:ucp-staging" in target:
            out.append(target)
    return out


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_round_trip_is_bit_equal_and_the_state_is_the_one_at_call_time(tmp_path: Path) -> None:
    model = w.build("plain")
    opt = w.make_optimizer(model)
    w.train(model, opt, 1)
    ema = torch.randn(3, 5, dtype=torch.bfloat16)
    with AsyncSaver(writer="process") as saver:
        assert saver.writer_pid not in (None, os.getpid())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt_before = {k: {n: t.clone() for n, t in s.items() if isinstance(t, torch.Tensor)}
                      for k, s in opt.state_dict()["state"].items()}
        first = saver.save(tmp_path / "a", model=model, optimizer=opt, step=1,
                           extra={"ema": ema}, durable=False)
        staged = saver.staging_bytes
        assert staged > 0
        w.train(model, opt, 1)  # changes every parameter, maybe while the child writes
        second = saver.save(tmp_path / "b", model=model, optimizer=opt, step=2, durable=False)
        assert first.done() and saver.staging_bytes == staged  # the same shared memory
        after = {k: v.clone() for k, v in model.state_dict().items()}
        second.result()
        mine = os.getpriority(os.PRIO_PROCESS, 0)  # the child yields the CPU by default
        assert os.getpriority(os.PRIO_PROCESS, saver.writer_pid) == min(19, mine + 10)
    assert second.result().tensors == first.result().tensors - 1  # no ema the second time
    assert _same_model(tmp_path / "a", before) and _same_model(tmp_path / "b", after)
    ck = ucpformat.open_checkpoint(tmp_path / "a")
    assert ck.values("training")["step"] == 1
    assert ck.tensor("training", "ema").read().tobytes() == _raw(ema)
    names = [n for n, _ in model.named_parameters()]
    for index, states in opt_before.items():
        for key, value in states.items():
            got = ck.tensor("optimizer", "state", names[index], key).read()
            assert got.tobytes() == _raw(value), (index, key)
    fresh = w.build("plain")
    assert ucpt.load(tmp_path / "b", model=fresh).step == 2
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, after[k]), k


def test_a_failure_in_the_child_is_raised_by_wait_and_the_previous_checkpoint_stays(
        tmp_path: Path) -> None:
    model = w.build("plain")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with AsyncSaver(writer="process") as saver:
        saver.save(tmp_path / "a", model=model, durable=False).result()
        pid = saver.writer_pid
        assert pid is not None
        # the child's writes past 128 bytes fail (EFBIG: Python ignores SIGXFSZ), as a
        # full disk's would, part way through the save
        soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (128, hard))
        try:
            saver.save(tmp_path / "b", model=model, durable=False)
            with pytest.raises(WriteError, match=os.strerror(errno.EFBIG)) as info:
                saver.wait()
        finally:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
        assert any(f"in the writer process (pid {pid})" in note
                   for note in info.value.__notes__)
        with pytest.raises(UCPError):
            ucpformat.open_checkpoint(tmp_path / "b")  # nothing committed
        # a UCPError keeps its class and rule: a committed checkpoint without overwrite
        saver.save(tmp_path / "a", model=model)
        with pytest.raises(ucpformat.errors.CheckpointExistsError, match=r"UCP-1\.0-R053"):
            saver.wait()
        saver.save(tmp_path / "c", model=model, durable=False).result()  # it goes on
        assert saver.writer_pid == pid
    assert _same_model(tmp_path / "a", state) and _same_model(tmp_path / "c", state)


class _FullDisk(LocalStore):
    """A store whose behaviour is code: it cannot travel to a writer process."""

    def create(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", key)


def test_what_cannot_travel_is_refused_before_the_child_hears_of_it(tmp_path: Path) -> None:
    model = w.build("plain")
    with AsyncSaver(writer="process") as saver:
        pid = saver.writer_pid
        with pytest.raises(InvalidValueError, match=r"_FullDisk cannot be sent to the writer "
                                                    r"process.*pass a path or URL"):
            saver.save(_FullDisk(tmp_path / "a"), model=model)
        with pytest.raises(InvalidValueError, match=r"progress=.*progress=True"):
            saver.save(tmp_path / "a", model=model, progress=lambda n: None)
        assert not (tmp_path / "a").exists() and saver.wait() is None  # nothing started
        # a plain store travels (as its location and settings), a path too
        saver.save(LocalStore(tmp_path / "a", durable=False), model=model).result()
        saver.save(tmp_path / "b", model=model, durable=False, progress=True).result()
        assert saver.writer_pid == pid
    assert _same_model(tmp_path / "a", model.state_dict())


def test_an_object_store_travels_as_its_url_and_storage_options() -> None:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from ucpformat.store import open_store
    from ucpformat.testing.s3 import BUCKET, s3_server

    model = w.build("plain")
    with s3_server() as options, AsyncSaver(writer="process") as saver:
        store = open_store(f"s3://{BUCKET}/proc-{os.getpid()}", storage_options=options)
        saver.save(store, model=model, step=3).result()  # rebuilt in the child, from JSON
        ck = ucpformat.open_checkpoint(store)
        assert ck.values("training")["step"] == 3
        assert all(ck.tensor("model", k).read().tobytes() == _raw(v)
                   for k, v in model.state_dict().items())


def test_the_childs_other_errors_name_their_class_and_message(tmp_path: Path) -> None:
    arena = SharedArena()
    writer = WriterProcess()
    try:
        arena.reserve(4096)
        # an argument save_fragments does not take: a TypeError in the child
        with pytest.raises(WriteError, match=r"the writer process failed: TypeError: .*"
                                             r"unexpected keyword argument 'colour'") as info:
            writer.save(arena, tmp_path / "a", specs=[], fragments=[], colour="red")
        assert type(info.value) is WriteError
        assert "Traceback" in info.value.__notes__[0] and "save_fragments" in \
            info.value.__notes__[0]
        assert writer.alive() and not (tmp_path / "a").exists()
    finally:
        writer.close()
        arena.close()


def test_a_killed_child_is_an_error_naming_it_and_a_new_one_takes_over(tmp_path: Path) -> None:
    model = w.build("plain")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with AsyncSaver(writer="process") as saver:
        saver.save(tmp_path / "a", model=model, durable=False).result()
        pid = saver.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the save below is in flight until the child dies
        future = saver.save(tmp_path / "b", model=model)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WriterProcessError, match=f"pid {pid}.*SIGKILL"):
            saver.wait()
        assert future.done()
        with pytest.raises(UCPError):
            ucpformat.open_checkpoint(tmp_path / "b")
        assert _same_model(tmp_path / "a", state)
        saver.save(tmp_path / "c", model=model, durable=False).result()
        assert saver.writer_pid not in (None, pid)
    assert _same_model(tmp_path / "c", state)


def test_close_leaves_no_process_and_no_shared_memory(tmp_path: Path) -> None:
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    memfds = len(_memfds())  # earlier tests' savers: closed (their mappings too, unless
    model = w.build("plain")  # an error's traceback kept a view)
    saver = AsyncSaver(writer="process", writer_nice=3)
    saver.save(tmp_path / "a", model=model, durable=False).result()
    pid = saver.writer_pid
    assert pid is not None and len(_memfds()) > memfds and not _gone(pid)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + 3)  # yields the CPU
    forked = os.fork()  # a forked copy of the trainer that ends leaves the writer alone
    if forked == 0:
        try:
            saver._process._finalizer()  # what its exit would run
        finally:
            os._exit(0)
    os.waitpid(forked, 0)
    saver.save(tmp_path / "b", model=model, durable=False).result()
    assert saver.writer_pid == pid and not _gone(pid)
    saver.close()
    assert _gone(pid)  # stopped and reaped
    assert len(_memfds()) == memfds
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) <= shm  # nothing named was ever made
    with pytest.raises(RuntimeError, match="closed"):
        saver.save(tmp_path / "c", model=model)
    with pytest.raises(ValueError, match="pool"):
        AsyncSaver(writer="process", pool=ucpt.staging.HostBufferPool(None))
    with pytest.raises(ValueError, match="writer_nice"):
        AsyncSaver(writer_nice=3)


def test_the_manager_tracks_saves_of_the_writer_process(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    weights = {}
    with AsyncSaver(writer="process") as saver, \
            CheckpointManager(tmp_path / "run", save_every=2, keep_last=2) as manager:
        for step in range(7):
            with torch.no_grad():
                model.weight.add_(1.0)
            weights[step] = model.weight.detach().clone()
            manager.maybe_save(step, lambda path, s=step: saver.save(path, model=model, step=s))
    assert manager.all_steps() == [4, 6]  # close() waited for step 6 and rotated
    fresh = torch.nn.Linear(4, 3)
    assert ucpt.load(manager.location(6), model=fresh).step == 6
    assert torch.equal(fresh.weight, weights[6])
    # save_async's own saver, in a process too; wait_async stops it
    with CheckpointManager(tmp_path / "run2", keep_last=1) as manager:
        manager.maybe_save(1, lambda path: save_async(path, model=model, step=1,
                                                      writer="process"))
    assert manager.all_steps() == [1]
    close_async()  # its writer process stops


@pytest.mark.distributed
def test_two_ranks_write_through_their_writer_processes(tmp_path: Path) -> None:
    from ucpformat.torch.launch import spawn

    out = spawn(w.async_process_two, 2, str(tmp_path), timeout=240)
    assert out[0]["writer_pid"] != out[1]["writer_pid"]
    for rank in range(2):
        assert out[rank]["tensors"] > 0 and out[rank]["second"] > 0
        assert "CheckpointExistsError" in out[rank]["failure"], out[rank]  # on every rank
        assert out[rank]["writer_gone"]
