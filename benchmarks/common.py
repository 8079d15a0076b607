"""Helpers shared by the throughput benchmarks: raw I/O baselines, peers, file counts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np


def files_under(path: str | os.PathLike[str]) -> list[str]:
    p = Path(path)
    if p.is_file():
        return [str(p)]
    return [str(f) for f in p.rglob("*") if f.is_file()]


def disk_bytes(path: str | os.PathLike[str]) -> int:
    return sum(os.path.getsize(f) for f in files_under(path))


def evict(path: str | os.PathLike[str]) -> None:
    """Drop the (clean) pages of every file under ``path`` from the page cache, so that
    the next read comes from the disk (``posix_fadvise(DONTNEED)``; no root needed, and
    nobody else's cache is touched)."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_path(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str | os.PathLike[str]) -> None:
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()


def raw_bytes(state: Mapping[str, Any]) -> Iterator[memoryview]:
    """Each tensor's bytes (no copy: CPU tensors share memory with these views)."""
    from ucpformat.torch.numpy_bridge import to_numpy

    for name, t in state.items():
        yield memoryview(to_numpy(t, name=name).reshape(-1).view(np.uint8))


def raw_write(path: str, state: Mapping[str, Any]) -> None:
    """The write limit: every tensor's bytes, back to back, into one file, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for view in raw_bytes(state):
            pos = 0
            while pos < len(view):
                pos += os.write(fd, view[pos:])
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def pread_exactly(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the bytes of ``fd`` from ``offset`` (OSError if the file ends
    first)."""
    pos = 0
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], offset + pos)
        if n == 0:
            raise OSError("short read")
        pos += n


def raw_read(path: str, layout: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> list[Any]:
    """The read limit: the same bytes, in order, into newly allocated arrays that are
    kept (as a real load keeps them: their pages are faulted in like a loader's)."""
    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for shape, dtype in layout:
            arr = np.empty(shape, dtype)
            view = memoryview(arr.reshape(-1).view(np.uint8))
            pread_exactly(fd, view, offset)
            offset += len(view)
            out.append(arr)
    finally:
        os.close(fd)
    return out


def numpy_layout(state: Mapping[str, Any]) -> list[tuple[tuple[int, ...], np.dtype[Any]]]:
    from ucpformat.torch.numpy_bridge import to_numpy

    return [(tuple(t.shape), to_numpy(t, name=n).dtype) for n, t in state.items()]


def buffer_module(state: Mapping[str, Any], *, empty: bool = False,
                  touched: bool = False) -> Any:
    """A torch module whose buffers are ``state``'s tensors under their dotted names
    (``empty``: new uninitialised tensors of the same shapes and types, memory not
    touched yet; with ``touched``, zeroed, as a model its constructor initialised holds
    them), so that the module-based APIs save and load exactly this state."""
    import torch

    root = torch.nn.Module()
    for name, t in state.items():
        *parents, leaf = name.split(".")
        node = root
        for part in parents:
            child = getattr(node, part, None) if part in node._modules else None
            if child is None:
                child = torch.nn.Module()
                node.add_module(part, child)
            node = child
        buffer = torch.empty_like(t) if empty else t
        node.register_buffer(leaf, buffer.zero_() if empty and touched else buffer)
    return root


def empty_like_state(state: Mapping[str, Any], *, touched: bool = False) -> dict[str, Any]:
    """New tensors of ``state``'s shapes and types (``touched``: zeroed, memory in use)."""
    import torch

    return {k: torch.zeros_like(v) if touched else torch.empty_like(v)
            for k, v in state.items()}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM`` of ``/proc/self/status``), in bytes.

    Not ``ru_maxrss``: Linux keeps that across ``fork`` and ``execve``, so a child of a
    large parent (the benchmark runner) would report the parent's peak.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> int:
    """Start the peak resident set over from the current one (Linux ``clear_refs`` 5), so
    that what imports held for a moment does not count; the current one, in bytes."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:  # pragma: no cover - not Linux, or not permitted
        pass
    return rss_bytes()


def io_read_chars() -> int:
    """Bytes this process has read through read/pread syscalls (``/proc/self/io``
    ``rchar``): counts page-cache hits too, so it measures what a loader asks for."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "n/a"
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


def run_child(function: str, *args: str, timeout: float = 1800) -> dict[str, Any]:
    """Call ``function`` (``"benchmarks.module:name"``, returning a JSON object) with the
    string ``args`` in a fresh Python process, and return what it returned: a figure of
    one operation in a process whose memory nothing before it has used."""
    module, name = function.split(":")
    code = (f"import json, sys; from {module} import {name}; "
            f"print('RESULT ' + json.dumps({name}(*sys.argv[1:])))")
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, cwd=root, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT "):])
            return result
    raise RuntimeError(f"{function}{list(args)} failed:\n{proc.stdout}\n{proc.stderr}")
