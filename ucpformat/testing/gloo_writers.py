"""Distributed writers for the harnesses: process groups that save when told to.

A :class:`WriterGroup` is ``world`` processes (``python -m ucpformat.testing.gloo_writers``)
that form one ``torch.distributed`` process group over gloo on the CPU (none for a group of
one) and stay up between trials, so that a harness pays for starting torch once, not per
save. The harness sends every rank of a group the same :class:`SaveOrder` (a JSON line
on its stdin); each rank waits for the order's start time, saves its share, and answers
with a JSON line: ``saved``, ``refused`` (a :class:`~ucpformat.errors.UCPError`, its rule
and message) or ``crashed`` (any other exception). Writers (``SaveOrder.writer``):

- ``distributed``: :func:`ucpformat.distributed.save_fragments` of
  :func:`ucpformat.testing.faults.distributed_parts` (rows split between the ranks); it
  loads back as :func:`distributed_expected`;
- ``dcp``: ``torch.distributed.checkpoint.save`` with :class:`ucpformat.torch.dcp.UCPWriter`
  of the model of :func:`~ucpformat.testing.common.small_state` as DTensors sharded on
  their rows; it loads back as :func:`dcp_expected`;
- ``single``: :func:`ucpformat.checkpoint.writer.save` of ``small_state`` in one process (a group
  of one); it loads back as ``small_state``.

Every writer's store sleeps ``delay`` seconds before each storage operation
(:class:`~ucpformat.testing.faults.FaultyStore`), so that saves overlap.
A group that does not answer within its time limit (counted once every worker has said
it is ready: torch imported, group joined) is killed and started again (the harness
counts a hang). Workers end, when told or when their stdin closes, with a
barrier, ``destroy_process_group()``, flushed output and ``os._exit(0)`` (gloo may abort
at interpreter shutdown otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import IO, Any
from unittest import mock

from ucpformat.errors import UCPError
from ucpformat.store import LocalStore, Store
from ucpformat.testing.common import SMALL_CHUNKING, small_state

WRITERS = ("distributed", "dcp", "single")
#: What a worker prints before each answer (other output may come from libraries).
ANSWER = "ucp-writer-answer "
#: What a worker prints once it has joined its group and is ready for orders.
READY = "ucp-writer-ready"
#: Seconds a group may take to start (import torch, join the group): not a save's time.
START_TIMEOUT = 300.0


@dataclass(frozen=True)
class SaveOrder:
    """One save, as every rank of a group is told to run it."""

    writer: str  # distributed | dcp | single
    target: str
    seed: int
    overwrite: bool = False
    start: float = 0.0  # time.time() at which to begin (0: at once)
    delay: float = 0.0  # seconds slept before each storage operation


@dataclass(frozen=True)
class Answer:
    """What one rank said of its save."""

    outcome: str  # saved | refused | crashed | hung
    end: float  # time.time() when the save returned
    why: str = ""  # the error: "<rule> <type>: <message>"
    rule: str = ""


def distributed_expected(seed: int) -> dict[str, Any]:
    """What a ``distributed`` save of ``seed`` loads back as."""
    from ucpformat.testing.faults import distributed_parts

    return distributed_parts(seed, 2).expected


def dcp_expected(seed: int) -> dict[str, Any]:
    """What a ``dcp`` save of ``seed`` loads back as."""
    return {"model": small_state(seed)["model"]}


def expected(writer: str, seed: int) -> dict[str, Any]:
    """What a save by ``writer`` of ``seed`` loads back as."""
    if writer == "distributed":
        return distributed_expected(seed)
    if writer == "dcp":
        return dcp_expected(seed)
    return small_state(seed)


# -- the harness's side --------------------------------------------------------------------


class WriterGroup:
    """``world`` worker processes forming one process group (gloo), started at once.

    ``setup``: ``"module:function"`` that every worker calls before its first save (the
    harness's own tests use it to put a fixed defect back, to show that the harness
    notices it)."""

    def __init__(self, world: int, *, timeout: float = 60.0, setup: str = "") -> None:
        self.world = world
        self.timeout = timeout
        self.setup = setup
        self._procs: list[subprocess.Popen[bytes]] = []
        self._buffers: list[bytearray] = []  # each worker's output not yet read as answers
        self._ready = False  # every worker has said READY
        self._deadline = 0.0
        self._start()

    def _start(self) -> None:
        from ucpformat.testing.faults import free_port

        port = free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self._procs = [
            subprocess.Popen(
                [sys.executable, "-m", "ucpformat.testing.gloo_writers", "--rank", str(r),
                 "--world", str(self.world), "--port", str(port),
                 *(["--setup", self.setup] if self.setup else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=env,
            )
            for r in range(self.world)
        ]
        self._buffers = [bytearray() for _ in self._procs]
        self._ready = False

    def send(self, order: SaveOrder) -> None:
        """Tell every rank to run ``order`` (its answers: :meth:`collect`)."""
        if not self._procs:
            self._start()
        self._await_ready()
        line = (json.dumps(asdict(order)) + "\n").encode()
        for proc in self._procs:
            assert proc.stdin is not None
            proc.stdin.write(line)
            proc.stdin.flush()
        self._deadline = max(order.start, time.time()) + self.timeout

    def _await_ready(self) -> None:
        """Wait for every worker of a group just started to say it is ready (the time
        limit of a save starts after this)."""
        if self._ready:
            return
        deadline = time.time() + START_TIMEOUT
        for proc, buffer in zip(self._procs, self._buffers, strict=True):
            said = _read_line(proc, buffer, deadline, READY)
            if said is not None:
                self.close(kill=True)
                raise RuntimeError(f"a writer group did not start: {said}")
            _take_line(buffer)
        self._ready = True

    def collect(self) -> list[Answer]:
        """Every rank's answer to the last order (``hung`` for a rank that gave none
        within the time limit: the group is then killed, and started again by the next
        order)."""
        answers = [_read_answer(p, b, self._deadline)
                   for p, b in zip(self._procs, self._buffers, strict=True)]
        if any(a.outcome == "hung" for a in answers):
            self.close(kill=True)  # started again by the next order
        return answers

    def save(self, order: SaveOrder) -> list[Answer]:
        """Every rank runs ``order``; their answers."""
        self.send(order)
        return self.collect()

    def close(self, *, kill: bool = False) -> None:
        """Tell every worker to end, and kill those that do not within seconds (at once
        if ``kill``)."""
        for proc in self._procs:
            if kill:
                proc.kill()
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.close()
        deadline = time.monotonic() + 20
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs = []

    def __enter__(self) -> WriterGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_answer(proc: subprocess.Popen[bytes], buffer: bytearray, deadline: float) -> Answer:
    """The next answer of ``proc`` (``buffer``: what was read of its output and not yet
    used), or ``hung`` at ``deadline`` (or if it died)."""
    said = _read_line(proc, buffer, deadline, ANSWER)
    if said is None:
        return Answer(**json.loads(_take_line(buffer)[len(ANSWER):]))
    return Answer("hung", time.time(), said)


def _take_line(buffer: bytearray) -> str:
    """The first line of ``buffer``, removed from it."""
    end = buffer.index(b"\n")
    text = buffer[:end].decode(errors="replace")
    del buffer[: end + 1]
    return text


def _read_line(proc: subprocess.Popen[bytes], buffer: bytearray, deadline: float,
               prefix: str) -> str | None:
    """Read ``proc``'s output up to its next line that starts with ``prefix``, leaving
    that line first in ``buffer``: None; or why there is none by ``deadline`` (the
    worker's last lines of other output)."""
    out = proc.stdout
    assert out is not None
    seen: list[str] = []
    while True:
        if b"\n" in buffer:
            if buffer.startswith(prefix.encode()):
                return None
            seen.append(_take_line(buffer)[:300])
            continue
        left = deadline - time.time()
        ready, _, _ = select.select([out], [], [], max(0.0, left))
        if not ready:
            if left <= 0:  # (what came before the deadline was read: it may be late)
                return "no answer in time: " + " | ".join(seen[-3:])
            continue
        chunk = os.read(out.fileno(), 1 << 16)
        if not chunk:
            return f"the worker ended ({proc.poll()}): " + " | ".join(seen[-5:])
        buffer += chunk


# -- the worker's side ---------------------------------------------------------------------


def _store(order: SaveOrder) -> Store:
    from ucpformat.testing.faults import FaultyStore

    inner = LocalStore(order.target, durable=False)
    return FaultyStore(inner, delay=order.delay) if order.delay else inner


def _save(order: SaveOrder, comm: Any) -> None:
    if order.writer == "single":
        from ucpformat.checkpoint.writer import save

        save(_store(order), small_state(order.seed), overwrite=order.overwrite, workers=2,
             durable=False, **SMALL_CHUNKING)
    elif order.writer == "distributed":
        from ucpformat.testing.faults import distributed_parts, distributed_save

        distributed_save(_store(order), comm, distributed_parts(order.seed, 2),
                         overwrite=order.overwrite)
    elif order.writer == "dcp":
        _dcp_save(order)
    else:
        raise ValueError(f"no writer {order.writer!r}")


def _dcp_save(order: SaveOrder) -> None:
    import numpy as np
    import torch
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ucpformat.torch.dcp import UCPWriter

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    model: dict[str, Any] = {}
    for name, array in small_state(order.seed)["model"].items():
        if array.dtype.name == "bfloat16":
            tensor = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(array.copy())
        model[name] = distribute_tensor(tensor, mesh, [Shard(0)], src_data_rank=None)
    writer = UCPWriter(order.target, overwrite=order.overwrite, durable=False, workers=2,
                       hash_algorithm="sha256", **SMALL_CHUNKING)
    # the plugin opens its store from the path: slowed down as the other writers' are
    with mock.patch("ucpformat.torch.dcp.open_store", lambda *_a, **_k: _store(order)):
        dcp_save({"model": model}, storage_writer=writer)


def _answer(order: SaveOrder, comm: Any) -> Answer:
    time.sleep(max(0.0, order.start - time.time()))
    try:
        _save(order, comm)
    except UCPError as exc:
        return Answer("refused", time.time(), f"{exc.rule or ''} {type(exc).__name__}: {exc}",
                      exc.rule or "")
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        ucp = _ucp_cause(exc)
        if ucp is not None:  # DCP wraps the coordinator's error in its own exception
            return Answer("refused", time.time(),
                          f"{ucp.rule or ''} {type(ucp).__name__}: {ucp}", ucp.rule or "")
        return Answer("crashed", time.time(), f"{type(exc).__name__}: {str(exc)[:2000]}")
    return Answer("saved", time.time())


def _ucp_cause(exc: BaseException) -> UCPError | None:
    """The UCPError that DCP's CheckpointException carries (per rank), if any."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            if isinstance(failure, tuple) and failure:  # (exception, its stack summary)
                failure = failure[0]
            found = _ucp_cause(failure) if isinstance(failure, BaseException) else None
            if found is not None:
                return found
    if isinstance(exc, UCPError):
        return exc
    seen = exc.__cause__ or exc.__context__
    return _ucp_cause(seen) if seen is not None else None


def worker(args: argparse.Namespace, stdin: IO[str]) -> int:
    """One rank: save what each line of ``stdin`` says, answer on stdout, until EOF."""
    comm: Any = None
    dist: Any = None
    if args.world > 1:
        import torch.distributed as dist

        from ucpformat.testing.gloo import communicator

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
            world_size=args.world, timeout=datetime.timedelta(seconds=30),
        )
        comm = communicator()
    if args.setup:
        module, _, function = args.setup.partition(":")
        getattr(importlib.import_module(module), function)()
    print(READY, flush=True)
    code = 0
    try:
        for line in stdin:
            if not line.strip():
                continue
            answer = _answer(SaveOrder(**json.loads(line)), comm)
            print(ANSWER + json.dumps(asdict(answer)), flush=True)
        if dist is not None:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as exc:
        print(f"rank {args.rank}: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never run gloo's shutdown (see DESIGN.md: aborts at exit)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucpformat.testing.gloo_writers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--setup", default="")
    return worker(parser.parse_args(argv), sys.stdin)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ANSWER", "READY", "START_TIMEOUT", "WRITERS", "Answer", "SaveOrder", "WriterGroup",
           "dcp_expected", "distributed_expected", "expected"]
