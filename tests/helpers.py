"""Helpers of the test suite: bit-exact comparison, random data, editing checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ucpformat.checkpoint.metadata import encode_root
from ucpformat.format.dtypes import DataType

# -- comparing -----------------------------------------------------------------------


def bits(a: Any) -> tuple[str, tuple[int, ...], bytes]:
    """What bit-exact equality compares: dtype, shape and raw bytes (NaN payloads, -0.0)."""
    arr = np.asarray(a)
    return (arr.dtype.str, arr.shape, np.ascontiguousarray(arr).tobytes())


def assert_bits_equal(actual: Any, expected: Any) -> None:
    a, e = bits(actual), bits(expected)
    assert a[:2] == e[:2], f"dtype/shape {a[:2]} != {e[:2]}"
    assert a[2] == e[2], "values differ bit-wise"


def random_array(
    rng: np.random.Generator, dt: DataType, shape: tuple[int, ...]
) -> np.ndarray[Any, Any]:
    """Random bits of ``dt`` (every NaN payload possible), with -0.0 and infinities mixed in."""
    n = int(np.prod(shape, dtype=np.int64))
    if dt.kind == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    arr = raw.view(dt.numpy).reshape(shape).copy()
    if dt.kind in ("float", "complex") and n:
        flat = arr.reshape(-1)
        specials = [-0.0, 0.0, 1.0]
        if dt.has_inf:
            specials += [np.inf, -np.inf]
        with np.errstate(all="ignore"):
            for i, v in zip(rng.integers(0, n, size=min(n, 4)), specials, strict=False):
                if dt.name == "float8_e8m0fnu":
                    continue  # no sign bit, no zero: random bits cover it
                flat[i] = v
    return arr


# -- editing checkpoints on disk -------------------------------------------------------


def read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def write_json(path: Path, doc: Any) -> None:
    path.write_bytes(json.dumps(doc, indent=2, ensure_ascii=False).encode())


def edit_root(ckpt: Path, fn: Callable[[dict[str, Any]], Any], *, seal: bool = True) -> None:
    """Change the root zarr.json in place (``fn`` mutates the document).

    ``seal``: give it the digest of its new bytes (UCP-1.0-R058), so that only ``fn``'s
    change is wrong; without, the edit is damage that ``open`` refuses (R058).
    """
    doc = read_json(ckpt / "zarr.json")
    fn(doc)
    attributes = doc.get("attributes") if isinstance(doc, dict) else None
    if seal and isinstance(attributes, dict) and isinstance(attributes.get("ucp"), dict):
        (ckpt / "zarr.json").write_bytes(encode_root(doc))
    else:
        write_json(ckpt / "zarr.json", doc)


def node_dir(ckpt: Path, node: str) -> Path:
    return ckpt.joinpath(*node.split("/"))


def edit_node(ckpt: Path, node: str, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Change a node's metadata consistently: its zarr.json, the consolidated copy, the
    manifest entry and the root's manifest reference, so that only ``fn``'s change is wrong."""
    own = node_dir(ckpt, node) / "zarr.json"
    doc = read_json(own)
    fn(doc)
    write_json(own, doc)
    edit_root(ckpt, lambda root: root["consolidated_metadata"]["metadata"].__setitem__(node, doc))
    refresh_manifest(ckpt)


def refresh_manifest(ckpt: Path) -> None:
    """Recompute sizes and hashes of every file the manifest lists, and its root reference."""
    mpath = ckpt / "manifest.ucp.json"
    manifest = read_json(mpath)
    for key, entry in manifest["files"].items():
        data = (ckpt / key).read_bytes()
        entry["nbytes"] = len(data)
        if "sha256" in entry:
            entry["sha256"] = hashlib.sha256(data).hexdigest()
    write_json(mpath, manifest)
    body = mpath.read_bytes()
    edit_root(
        ckpt,
        lambda root: root["attributes"]["ucp"]["manifest"].update(
            nbytes=len(body), sha256=hashlib.sha256(body).hexdigest()
        ),
    )


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte of a file (negative offsets count from the end)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes (to prove nothing changed)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def write_explicit(
    path: Path,
    arrays: dict[str, tuple[np.ndarray[Any, Any], tuple[int, ...], tuple[int, ...] | None,
                            str | None]],
    *,
    hash_algorithm: str | None = "sha256",
) -> Path:
    """A checkpoint whose arrays have exactly the given (chunk shape, shard shape or None,
    compression), written by the writer's own object encoder and commit: tests that flip
    a byte of a given chunk must not depend on the chunking heuristics of ``save``."""
    from ucpformat.checkpoint import commit as protocol
    from ucpformat.checkpoint import tree, writer
    from ucpformat.checkpoint.metadata import ArrayMeta, GroupMeta, default_producer
    from ucpformat.engine.compression import Compression
    from ucpformat.format.dtypes import from_numpy
    from ucpformat.store import LocalStore

    metas = []
    groups: set[str] = set()
    for node, (arr, chunk, shard, compression) in arrays.items():
        dt = from_numpy(arr.dtype)
        metas.append((ArrayMeta(path=node, shape=arr.shape, dtype=dt, chunk_shape=chunk,
                                shard_shape=shard, compression=Compression.parse(compression, dt),
                                fill_value=tree.zero_bits(dt)), arr))
        parts = node.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
    store = LocalStore(path, durable=False)
    protocol.prepare_destination(store, overwrite=False)
    objects = writer.write_arrays(store, metas, hash_algorithm=hash_algorithm)
    protocol.commit_checkpoint(store, arrays=[m for m, _ in metas],
                  groups=[GroupMeta(g) for g in sorted(groups)], objects=objects,
                  root_ucp={"producer": default_producer()}, hash_algorithm=hash_algorithm)
    return path


# -- staging ------------------------------------------------------------------------


class FailingCopier:
    """A copier of :class:`ucpformat.torch.staging.Staging` that copies on the CPU and
    fails (a lost device) on its ``bad``-th copy (never if ``bad`` is 0)."""

    def __init__(self, bad: int) -> None:
        self.bad, self.n = bad, 0

    def begin(self, tensors: Any) -> None:
        pass

    def copy(self, dst: Any, src: Any) -> Any:
        self.n += 1
        if self.n == self.bad:
            raise RuntimeError("device lost")
        dst.copy_(src)
        return None

    def wait(self, done: Any) -> None:
        pass

    def guard(self, done: Any) -> None:
        pass


def fail_fsync(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """Make the store's ``call``-th fsync (counting from 1) fail with EIO, as a disk
    would; the others run."""
    calls = {"n": 0}
    real = os.fsync

    def failing(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == call:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr("ucpformat.store.os.fsync", failing)


# -- several processes -------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(module: str, args: list[str], root: Path, world: int, name: str,
           timeout: float = 240, extra_env: dict[str, str] | None = None) -> None:
    """Run ``python -m module *args`` on ``world`` ranks with torchrun's variables set;
    output goes to files under ``root`` (a full pipe blocks); a failing rank fails the
    test with its log."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.update(extra_env or {})
    logs = [root / f"{name}-rank{r}.log" for r in range(world)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=REPO, stdout=out,
                stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(f"--- {name} rank {r} (exit {procs[r].returncode}):\n"
                                  f"{logs[r].read_text()[-5000:]}" for r in failed)


def ucp(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the ``ucp`` command in process: (exit status, stdout, stderr)."""
    from ucpformat.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The error line a command printed last, with no traceback on stderr."""
    lines = err.strip().splitlines()
    assert lines, "expected an error line on stderr"
    assert "Traceback" not in err
    return lines[-1]
