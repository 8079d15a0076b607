"""What the importers and exporters share (:mod:`ucpformat.importers`, :mod:`ucpformat.exporters`).

* The memory bound of a streaming conversion: :data:`DEFAULT_MEMORY_LIMIT` and
  :func:`bounded_map`, which runs the reads and writes of many tensors on a pool of
  threads with at most that many bytes in flight.
* Sizes given as text (``--memory-limit 4GiB``, ``max_shard_size="5GB"``):
  :func:`parse_size`.
* torch for conversions that need it, imported only when they run (a safetensors
  conversion never imports it): :func:`torch_module` (an error saying how to install it
  where it is missing), and the bit-exact conversions of :mod:`ucpformat.torch.numpy_bridge`
  (:func:`data_type_of`, :func:`torch_dtype_of`, :func:`to_numpy`, :func:`from_numpy`).
* What both directions say of a format: safetensors' data-type codes
  (:data:`SAFETENSORS_TO_UCP`, :data:`UCP_TO_SAFETENSORS`); whether a value is stored as
  JSON (:func:`is_json_value`); a conversion's result as JSON (:func:`result_to_json`).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ucpformat.errors import InvalidValueError
from ucpformat.format import jsonvalues
from ucpformat.format.dtypes import DataType
from ucpformat.optional import require

if TYPE_CHECKING:
    import torch

#: safetensors' data-type codes -> the names of format 1.0's closed list.
SAFETENSORS_TO_UCP: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
#: The reverse of :data:`SAFETENSORS_TO_UCP`.
UCP_TO_SAFETENSORS: dict[str, str] = {v: k for k, v in SAFETENSORS_TO_UCP.items()}


def is_json_value(value: Any) -> bool:
    """Whether ``value`` is stored as a JSON value (spec section "JSON values")."""
    try:
        jsonvalues.encode(value, where="")
    except InvalidValueError:
        return False
    return True


def result_to_json(result: Any) -> dict[str, Any]:
    """An import or export result (a dataclass) as JSON: tuples as lists, seconds rounded
    to the millisecond."""
    doc: dict[str, Any] = {}
    for f in dataclasses.fields(result):
        value = getattr(result, f.name)
        doc[f.name] = (round(value, 3) if f.name == "seconds" else
                       list(value) if isinstance(value, tuple) else value)
    return doc


#: Default bound on tensor bytes held in memory at once by a conversion.
DEFAULT_MEMORY_LIMIT = 1 << 30

T = TypeVar("T")
R = TypeVar("R")


# -- bounded memory ---------------------------------------------------------------------


def bounded_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    size: Callable[[T], int],
    *,
    workers: int,
    memory_limit: int,
) -> Iterator[R]:
    """``fn`` over ``items`` on a pool of threads, results in order, bounded memory.

    An item's ``size`` bytes are reserved before ``fn`` starts and released once the
    caller has taken its result (so a result may be the data itself). At most
    ``memory_limit`` bytes are reserved at once, except that one item larger than the
    limit runs alone. Items start in order; an error is raised in order, and items not
    yet started are cancelled.
    """
    if memory_limit <= 0:
        raise InvalidValueError(f"memory_limit must be positive, got {memory_limit}")
    workers = max(1, workers)
    queue: collections.deque[tuple[Future[R], int]] = collections.deque()
    used = 0
    it = iter(items)
    end = object()
    nxt: Any = next(it, end)
    with ThreadPoolExecutor(workers) as pool:
        try:
            while queue or nxt is not end:
                while nxt is not end and len(queue) < 2 * workers:
                    want = min(max(size(nxt), 0), memory_limit)
                    if queue and used + want > memory_limit:
                        break
                    queue.append((pool.submit(fn, nxt), want))
                    used += want
                    nxt = next(it, end)
                future, held = queue.popleft()
                result = future.result()
                yield result
                used -= held
        finally:
            for future, _ in queue:
                future.cancel()


# -- sizes ------------------------------------------------------------------------------


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str) -> int:
    """``5000000000``, ``"5GB"`` (decimal, as Hugging Face counts) or ``"4GiB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise InvalidValueError(f"size must be positive, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise InvalidValueError(f"not a size: {value!r} (e.g. 5GB, 500MiB, 1000000)")
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if n <= 0:
        raise InvalidValueError(f"size must be positive, got {value!r}")
    return n


# -- torch, imported on use -------------------------------------------------------------


def torch_module() -> Any:
    """The torch module; a ``MissingDependencyError`` naming the extra where it is missing."""
    return require("torch", extra="import", purpose="this conversion")


def data_type_of(dtype: torch.dtype, *, tensor: str | None = None) -> DataType:
    """The closed-list entry of a torch dtype (``ucpformat.torch.numpy_bridge``)."""
    from ucpformat.torch.numpy_bridge import data_type

    return data_type(dtype, tensor=tensor)


def torch_dtype_of(dt: DataType, *, tensor: str | None = None) -> torch.dtype:
    from ucpformat.torch.numpy_bridge import torch_dtype

    return torch_dtype(dt, tensor=tensor)


def to_numpy(t: torch.Tensor, *, name: str | None = None) -> np.ndarray[Any, Any]:
    """A numpy array with the exact bits of ``t`` (shares memory when it can)."""
    from ucpformat.torch.numpy_bridge import to_numpy as convert

    return convert(t, name=name)


def from_numpy(a: np.ndarray[Any, Any], *, name: str | None = None) -> torch.Tensor:
    """A torch tensor with the exact bits of ``a`` (shares memory when it can)."""
    from ucpformat.torch.numpy_bridge import from_numpy as convert

    return convert(a, name=name)


__all__ = [
    "DEFAULT_MEMORY_LIMIT",
    "bounded_map",
    "data_type_of",
    "from_numpy",
    "parse_size",
    "to_numpy",
    "torch_dtype_of",
    "torch_module",
]
