"""torch file helpers of the importers (torch is imported lazily, by callers; torch itself
and the tensor <-> numpy conversions are in :mod:`ucpformat.interchange`).

* :func:`load_restricted`: ``torch.load(weights_only=True)`` with an allowlist of
  stand-in classes for the few framework classes a checkpoint names (DeepSpeed's
  ``fragment_address``, ``LossScaler``, ``ZeroStageEnum``; Megatron's
  ``argparse.Namespace``). The stand-ins are plain classes of this module: unpickling
  never imports the framework and never runs code the file names.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ucpformat.errors import FormatError
from ucpformat.interchange import to_numpy, torch_module

if TYPE_CHECKING:
    import torch

_LOCK = threading.RLock()


# -- stand-ins for framework classes ----------------------------------------------------

@dataclass
class FragmentAddress:
    """DeepSpeed's ``deepspeed.utils.tensor_fragment.fragment_address`` (a dataclass)."""

    numel: int = 0
    start: int = 0


class LossScalerStandIn:
    """DeepSpeed's loss scalers: only their attributes are kept."""

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(state)


class ZeroStageStandIn(enum.IntEnum):
    """DeepSpeed's ``ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


#: Fully qualified names in DeepSpeed and Megatron files -> their stand-ins.
STAND_INS: dict[str, Any] = {
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerStandIn,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerStandIn,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageStandIn,
    "argparse.Namespace": argparse.Namespace,
}


def _numpy_globals() -> list[Any]:
    """numpy objects that RNG states hold (Megatron saves ``np.random.get_state()``)."""
    out: list[Any] = [np.ndarray, np.dtype]
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    out.append((_reconstruct, "numpy.core.multiarray._reconstruct"))
    out.append((_reconstruct, "numpy._core.multiarray._reconstruct"))
    for name in ("UInt32DType", "Int64DType", "Float64DType", "UInt8DType", "Int32DType"):
        cls = getattr(np.dtypes, name, None)
        if cls is not None:
            out.append(cls)
    out.append((np.dtype, "numpy.dtype"))
    return out


@contextmanager
def _allowed(stand_ins: Mapping[str, Any]) -> Iterator[None]:
    torch = torch_module()
    allow: list[Any] = [(obj, name) for name, obj in stand_ins.items()]
    allow.extend(_numpy_globals())
    with _LOCK, torch.serialization.safe_globals(allow):
        yield


def load_restricted(
    path: str | os.PathLike[str],
    *,
    mmap: bool = True,
    stand_ins: Mapping[str, Any] | None = None,
) -> Any:
    """``torch.load`` with ``weights_only=True``: tensors, containers and allowlisted stand-ins.

    ``mmap=True`` maps tensor data instead of reading it (zip-format files only; older
    files are read whole). A file that names anything else is refused with the list of
    what it names, never unpickled.
    """
    torch = torch_module()
    allowed = STAND_INS if stand_ins is None else stand_ins
    try:
        with _allowed(allowed):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as exc:
                if mmap and "mmap" in str(exc):
                    return torch.load(path, map_location="cpu", weights_only=True)
                raise
    except Exception as exc:
        if type(exc).__name__ != "UnpicklingError" and "weights_only" not in str(exc):
            raise FormatError(f"cannot read this torch file: {type(exc).__name__}: {exc}",
                              path=str(path)) from None
        try:
            with _allowed(allowed):
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:
            unsafe = []
        listed = ", ".join(unsafe[:8]) or "(see the error above)"
        raise FormatError(
            "this torch file names Python objects beyond tensors, containers and the known "
            f"framework classes: {listed}. ucpformat loads torch files with weights_only=True "
            "and never unpickles arbitrary objects; convert it with the framework's own "
            f"tools first. ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
            path=str(path),
        ) from None


def is_tensor(value: Any) -> bool:
    torch = torch_module()
    return isinstance(value, torch.Tensor)


def tensor_reader(
    t: torch.Tensor, name: str, *, mapped: bool = False
) -> Callable[[], np.ndarray[Any, Any]]:
    """A reader that copies ``t`` out when called.

    ``mapped``: ``t`` lies in a read-only file mapping (``torch.load(mmap=True)``); its
    pages are handed back to the kernel after the copy, so that a conversion's resident
    memory does not grow with the source's size.
    """

    def read() -> np.ndarray[Any, Any]:
        out = np.array(to_numpy(t, name=name), copy=True)
        if mapped:
            drop_pages(t)
        return out

    return read


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4


def _libc() -> Any:
    import ctypes

    try:  # the process's own symbols: libc is linked in (no subprocess, unlike find_library)
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return lib


_LIBC: Any = None


def drop_pages(t: torch.Tensor) -> None:
    """Release the resident pages of a tensor that lies in a read-only *file* mapping.

    Only for tensors of ``torch.load(mmap=True)`` (a private file mapping never written
    to): the kernel re-reads the pages from the file if they are touched again. Never
    call this on ordinary memory (its contents would be lost). Linux only; a no-op
    elsewhere.
    """
    global _LIBC
    if not sys.platform.startswith("linux"):
        return
    nbytes = t.numel() * t.element_size()
    if nbytes < _PAGE:
        return
    if _LIBC is None:
        _LIBC = _libc() or False
    if not _LIBC:
        return
    start = t.data_ptr()
    lo = -(-start // _PAGE) * _PAGE  # only whole pages inside the tensor
    hi = (start + nbytes) // _PAGE * _PAGE
    if hi > lo:
        _LIBC.madvise(lo, hi - lo, _MADV_DONTNEED)


def plain(value: Any) -> Any:
    """A loaded non-tensor value made JSON-ready where possible (tensors -> lists)."""
    torch = torch_module()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, argparse.Namespace):
        return plain(vars(value))
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.Size):
        return list(value)
    return value


__all__ = [
    "STAND_INS",
    "FragmentAddress",
    "drop_pages",
    "is_tensor",
    "load_restricted",
    "plain",
    "tensor_reader",
]
