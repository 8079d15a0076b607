"""torch.Tensor <-> numpy, bit for bit, for every data type of the closed list torch has.

Native numpy types (bool, integers, float16/32/64, complex) convert with
``Tensor.numpy()`` / ``torch.from_numpy``. numpy has no bfloat16 or float8, so those
tensors are reinterpreted through an integer type of the same width and viewed as the
matching ``ml_dtypes`` type. Either way the bits are kept exactly (NaN payloads, -0.0,
subnormals) and no data is copied when the tensor is already a contiguous CPU tensor.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import torch

from ucpformat.errors import InvalidValueError, UnsupportedDtypeError
from ucpformat.format import dtypes
from ucpformat.format.dtypes import DataType


def _tables() -> tuple[dict[torch.dtype, DataType], dict[str, torch.dtype]]:
    to_data_type: dict[torch.dtype, DataType] = {}
    to_torch: dict[str, torch.dtype] = {}
    for dt in dtypes.DATA_TYPES:
        tdt = getattr(torch, dt.torch_name, None) if dt.torch_name else None
        if isinstance(tdt, torch.dtype):  # older torch builds lack some types
            to_data_type[tdt] = dt
            to_torch[dt.name] = tdt
    return to_data_type, to_torch


_TABLES = _tables()
#: torch dtype -> entry of the closed data-type list, for every type both know.
DATA_TYPE_OF_TORCH: Final[dict[torch.dtype, DataType]] = _TABLES[0]
#: zarr data-type name -> torch dtype.
TORCH_OF_DATA_TYPE: Final[dict[str, torch.dtype]] = _TABLES[1]

# Integer types that carry the bits of types numpy lacks, by item size.
_TORCH_CARRIER: Final = {1: torch.uint8, 2: torch.int16}
_NUMPY_CARRIER: Final = {1: np.dtype(np.uint8), 2: np.dtype(np.int16)}


def data_type(dtype: torch.dtype, *, tensor: str | None = None) -> DataType:
    """The closed-list entry of a torch dtype; ``UnsupportedDtypeError`` naming ``tensor``."""
    found = DATA_TYPE_OF_TORCH.get(dtype)
    if found is None:
        raise UnsupportedDtypeError(
            f"torch data type {dtype} has no entry in the closed list of format 1.0 "
            f"({', '.join(dtypes.NAMES)})",
            rule="UCP-1.0-R020",
            tensor=tensor,
        )
    return found


def torch_dtype(dt: DataType | str, *, tensor: str | None = None) -> torch.dtype:
    """The torch dtype of a closed-list data type (or its name)."""
    name = dt if isinstance(dt, str) else dt.name
    found = TORCH_OF_DATA_TYPE.get(name)
    if found is None:
        raise UnsupportedDtypeError(
            f"data type {name!r} has no torch equivalent in torch {torch.__version__}",
            rule="UCP-1.0-R020",
            tensor=tensor,
        )
    return found


def to_numpy(tensor: torch.Tensor, *, name: str | None = None) -> np.ndarray[Any, Any]:
    """A numpy array with the exact bits of ``tensor``.

    Shares memory with ``tensor`` when it is a contiguous CPU tensor. A tensor on another
    device is copied to the CPU, a non-contiguous one made contiguous (a copy), and a
    conjugate or negative view resolved (a copy). The gradient flag is ignored. Raises
    ``UnsupportedDtypeError`` (a dtype outside the closed list: quantized, float4, ...)
    or ``InvalidValueError`` (sparse, meta, distributed tensors), naming ``name``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidValueError(f"expected a torch.Tensor, got {type(tensor).__name__}",
                                tensor=name)
    if type(tensor).__name__ == "DTensor":
        raise InvalidValueError(
            "is a DTensor (a shard of a distributed tensor); this single-process API "
            "needs whole tensors (call .full_tensor(), or use the distributed save)",
            tensor=name,
        )
    dt = data_type(tensor.dtype, tensor=name)
    if tensor.layout != torch.strided:
        raise InvalidValueError(
            f"has layout {tensor.layout}; only dense (strided) tensors can be stored "
            "(call .to_dense() first)",
            tensor=name,
        )
    if tensor.device.type == "meta":
        raise InvalidValueError("is on the meta device and holds no data", tensor=name)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if dt.is_extension:
        return t.view(_TORCH_CARRIER[dt.itemsize]).numpy().view(dt.numpy)
    return t.numpy()


def from_numpy(
    array: np.ndarray[Any, Any],
    *,
    name: str | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """A torch tensor with the exact bits of ``array``.

    Shares memory with ``array`` when it is C-contiguous, writeable and in native byte
    order (as arrays read from a checkpoint are) and ``device`` is the CPU; otherwise
    the data is copied. Raises ``UnsupportedDtypeError`` naming ``name`` for a dtype
    outside the closed list or one this torch lacks.
    """
    arr = np.asarray(array)
    dt = dtypes.from_numpy(arr.dtype, tensor=name)
    tdt = torch_dtype(dt, tensor=name)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        # torch.from_numpy shares memory: a read-only array would be written through
        arr = np.array(arr, order="C", copy=True)
    if dt.is_extension:
        out = torch.from_numpy(arr.view(_NUMPY_CARRIER[dt.itemsize])).view(tdt)
    else:
        out = torch.from_numpy(arr)
    if device is not None and torch.device(device) != out.device:
        out = out.to(device)
    return out
