"""Host memory for the new arrays a load reads into.

A load into new arrays writes every page of them once, and where they come from decides
what that costs. ``np.empty`` advises the kernel to back an array of 4 MiB or more with
transparent huge pages; a kernel whose ``defrag`` setting is ``madvise`` (the usual
default) then compacts memory inside those page faults, which stalls where memory is
fragmented (a page cache full of checkpoint files, as on a training node). A new process
loading 2 GiB that way spent 3.4 to 5.7 s cold and 1.0 to 3.0 s warm, against 1.7 to
2.5 s and 0.8 to 1.8 s with the arrays mapped here (BENCHMARKS.md, "New memory for a
load"). :func:`new_array` maps an array of :data:`MAPPED_BYTES` or more as private
anonymous memory without that advice: its pages are faulted in by the threads that read
into them, as the reads go. Smaller arrays, and systems without anonymous mappings, get
``np.empty``. A mapping is released when the last array or tensor viewing it is.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Arrays of this many bytes or more are mapped (numpy's huge-page advice starts here).
MAPPED_BYTES = 4 << 20
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)


def new_array(shape: Sequence[int], dtype: Any) -> np.ndarray[Any, Any]:
    """A new, writable, C-contiguous array of ``shape`` and ``dtype`` whose contents are
    undefined (as ``np.empty``'s), to be filled by a read."""
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if _ANONYMOUS is None or nbytes < MAPPED_BYTES:
        return np.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | _ANONYMOUS)
    return np.frombuffer(memory, dtype=dtype).reshape(shape)


__all__ = ["MAPPED_BYTES", "new_array"]
