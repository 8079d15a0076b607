"""Staged bytes moved into a live tensor's memory by remapping pages instead of copying.

A staged load (:mod:`ucpformat.torch.reads`) holds a host copy of everything the model
receives until every read has been checked, then puts it into the model's tensors.
Copying it costs a pass over the memory and, where the target's pages were never
touched (a model made with ``torch.empty`` or ``to_empty``), a page fault per 4 KiB:
most of what the default load cost beyond a load into new tensors (issue 28).

On Linux, the staging of a large contiguous CPU target is instead a private anonymous
mapping of its own (:func:`staging_array`), its bytes at the same offset within a page
as the target's; once everything is checked, :func:`move_into` moves
its whole pages into the target's address range with one ``mremap`` (``MREMAP_FIXED |
MREMAP_DONTUNMAP``) and copies the few bytes at either end that share a page with other
memory. The target keeps its addresses and its storage (copied into, never replaced:
every view, alias and tied name sees the new values, as after a copy); its previous
pages are released. Only a target whose memory is a private anonymous mapping (or the
heap: what torch's CPU allocator gives; not a file mapping, shared memory or a pinned
buffer) is moved into; anything else, or a kernel that refuses, is copied as before.
The staging is reported to :mod:`tracemalloc` as numpy reports its arrays.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import weakref
from typing import Any

import numpy as np
import torch

#: Targets with fewer bytes are staged in ordinary memory and copied (moving pages
#: splits the target's mapping: worth it for large tensors only).
MOVE_MIN_BYTES = 1 << 20

_PAGE = mmap.PAGESIZE
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # Linux, every architecture
_TRACE_DOMAIN = 0x55C9  # tracemalloc domain of the staging mappings (numpy has its own)

#: Staging mappings alive: address of the first staged byte -> (start, length) of the
#: array; what :func:`move_into` may move from.
_staged: dict[int, tuple[int, int]] = {}
_lock = threading.Lock()
_libc: Any = None
_usable = sys.platform.startswith("linux") and hasattr(mmap, "MAP_ANONYMOUS")


def _lib() -> Any:
    global _libc, _usable
    if _libc is None:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                   ctypes.c_int, ctypes.c_void_p]
            lib.mremap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_long]
            lib.mmap.restype = ctypes.c_void_p
        except (OSError, AttributeError):
            _usable = False
            return None
        _libc = lib
    return _libc


def _eligible(target: torch.Tensor) -> bool:
    """A contiguous CPU tensor (not pinned) large enough to move pages into."""
    if not _usable or target.device.type != "cpu" or target.layout != torch.strided:
        return False
    if not target.is_contiguous() or target.is_conj() or target.is_neg():
        return False
    if target.numel() * target.element_size() < MOVE_MIN_BYTES:
        return False
    # pinned (or CUDA-registered) memory must stay where it is; nothing is pinned
    # before CUDA is initialised (and asking would initialise it)
    return not (torch.cuda.is_initialized() and target.is_pinned())  # type: ignore[no-untyped-call]


def staging_array(
    target: torch.Tensor, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> np.ndarray[Any, Any] | None:
    """A new array of ``shape`` and ``dtype`` (the target's bytes) in a mapping of its
    own, at the target's offset within a page, or None if the target does not
    qualify (the caller stages it in ordinary memory)."""
    if not _eligible(target) or _lib() is None:
        return None
    nbytes = target.numel() * target.element_size()
    if nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        return None
    try:
        region = mmap.mmap(-1, nbytes + _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    # (no huge pages: on the machines measured, faulting them in cost more system time
    # than 4 KiB pages filled by the reads themselves)
    whole = np.frombuffer(region, dtype=np.uint8)
    base = whole.ctypes.data
    offset = target.data_ptr() % _PAGE  # opposite every whole page of the target, one
    array = whole[offset:offset + nbytes].view(dtype).reshape(shape)
    start = base + offset
    with _lock:
        _staged[start] = (start, nbytes)
    ctypes.pythonapi.PyTraceMalloc_Track(_TRACE_DOMAIN, ctypes.c_size_t(base),
                                         ctypes.c_size_t(nbytes))
    weakref.finalize(region, _released, start, base)
    return array


def _released(start: int, base: int) -> None:
    with _lock:
        _staged.pop(start, None)
    ctypes.pythonapi.PyTraceMalloc_Untrack(_TRACE_DOMAIN, ctypes.c_size_t(base))


def anonymous_ranges() -> list[tuple[int, int]]:
    """``(start, end)`` of every private anonymous mapping of this process (from
    ``/proc/self/maps``; empty where that cannot be read)."""
    out: list[tuple[int, int]] = []
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if fields[1].startswith("rw") and fields[1][3] == "p" and fields[4] == "0" \
                        and (len(fields) == 5 or fields[5].strip() == "[heap]"):
                    lo, _, hi = fields[0].partition("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return out


def _inside(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    return any(a <= lo and hi <= b for a, b in ranges)


def move_into(target: torch.Tensor, data: torch.Tensor,
              ranges: list[tuple[int, int]]) -> bool:
    """Put ``data`` (an array of :func:`staging_array` made for ``target``, as a tensor)
    into ``target``'s memory by moving its whole pages there, the partial pages at either
    end copied; ``ranges``: :func:`anonymous_ranges`, read once before the first move.
    False (nothing done) if they do not qualify: the caller copies."""
    if data.dtype != target.dtype or not _eligible(target) or _libc is None:
        return False
    nbytes = target.numel() * target.element_size()
    src, dst = data.data_ptr(), target.data_ptr()
    with _lock:
        staged = _staged.get(src)
    if staged is None or staged[1] != nbytes or (src - dst) % _PAGE:
        return False
    lo = -(-dst // _PAGE) * _PAGE
    hi = (dst + nbytes) // _PAGE * _PAGE
    if hi <= lo or not _inside(ranges, lo, hi):
        return False
    mine = target.detach().reshape(-1).view(torch.uint8).numpy()
    theirs = data.reshape(-1).view(torch.uint8).numpy()
    got = _libc.mremap(src + (lo - dst), hi - lo, hi - lo,
                       _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP, lo)
    if got is None or got == _MAP_FAILED or got != lo:
        # A refused move may have unmapped the target's pages already (the kernel frees
        # the destination first): map new memory there and copy everything; the
        # target's old values were to be replaced anyway.
        fixed = _libc.mmap(lo, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE,
                           mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
        if fixed != lo:
            raise MemoryError(f"could not map {hi - lo} bytes of a tensor's memory again "
                              f"(errno {ctypes.get_errno()})")
        np.copyto(mine, theirs)
        return True
    np.copyto(mine[:lo - dst], theirs[:lo - dst])
    np.copyto(mine[hi - dst:], theirs[hi - dst:])
    return True


__all__ = ["MOVE_MIN_BYTES", "anonymous_ranges", "move_into", "staging_array"]
