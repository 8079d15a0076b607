"""A flat mapping of names to tensors, the way safetensors users work with one.

::

    ucpt.save_file({"embed.weight": w, "lm_head.weight": w}, "ckpt", metadata={"run": "a"})
    tensors = ucpt.load_file("ckpt", device="cpu")
    with ucpt.safe_open("ckpt", framework="pt", device="cpu") as f:
        f.keys()                                   # the metadata only, no tensor read
        f.get_tensor("embed.weight")
        f.get_slice("embed.weight")[:, :16]        # reads only the chunks it overlaps

The tensors are those of the group ``model`` (``prefix=`` for another group), so that a
file saved here is a UCP checkpoint like any other: ``ucpformat.torch.load`` loads it into
a module, ``ucp inspect`` shows it, any zarr v3 reader reads it. docs/torch.md says where
this differs from safetensors and why.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ucpformat.checkpoint.reader import Checkpoint, Tensor, open_checkpoint
from ucpformat.checkpoint.writer import SaveResult
from ucpformat.errors import InvalidValueError, LoadError, TensorNotFoundError, UCPError
from ucpformat.format import names
from ucpformat.store import Store
from ucpformat.torch.load_plan import check_device
from ucpformat.torch.numpy_bridge import from_numpy
from ucpformat.torch.reads import TensorRead, read_tensors

Device = str | int | torch.device
#: ``save_file``'s inner chunk size: a tensor up to this size is one chunk, which
#: ``load_file`` hands out in place (a mapping of its file, checked first).
FLAT_CHUNK_BYTES = 1 << 30
#: ``framework`` values of :func:`safe_open`, and whether each gives numpy arrays.
FRAMEWORKS = {"pt": False, "torch": False, "np": True, "numpy": True}


def _device(device: Device) -> torch.device:
    """A torch device; an integer is a CUDA device index, as safetensors takes it."""
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str] | Store,
    metadata: Mapping[str, Any] | None = None,
    **save_kwargs: Any,
) -> SaveResult:
    """Save a mapping of names to tensors as a checkpoint whose ``model`` group holds them.

    ``metadata``: any JSON object (UCP-1.0-R070), stored in the root. Names that hold the
    same tensor (one memory, viewed the same way: a tied weight) are stored once, the
    others as aliases (UCP-1.0-R108), and load as one tensor again. ``save_kwargs`` go to
    ``ucpformat.save`` (``overwrite=True`` to replace a checkpoint, ``compression``, ...).

    A ``path`` ending in ``.ucpz`` is written as one file (a ZIP archive, spec §11.5),
    any other as a directory. Each tensor of up to :data:`FLAT_CHUNK_BYTES` is one
    chunk (``chunk_bytes=`` and ``chunk_splits=`` choose smaller ones, which a slice
    reads less of), so that :func:`load_file` can use it in place.
    """
    from ucpformat.torch.state import save

    if not isinstance(tensors, Mapping):
        raise InvalidValueError(
            f"expected a mapping of names to tensors, got a {type(tensors).__name__}",
            path=os.fspath(path) if not isinstance(path, Store) else path.location,
        )
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise InvalidValueError(f"tensor names are strings, got {name!r}", path="model")
        if not isinstance(value, torch.Tensor):
            raise InvalidValueError(
                f"a {type(value).__name__}, not a tensor (save_file stores tensors only; "
                "other values go in metadata=)", tensor=f"model/{name}",
            )
    if "options" not in save_kwargs:
        save_kwargs.setdefault("chunk_bytes", FLAT_CHUNK_BYTES)
        save_kwargs.setdefault("chunk_splits", 1)
    return save(path, model=tensors, metadata=metadata, **save_kwargs)


def load_file(
    path: str | os.PathLike[str] | Store | Checkpoint,
    device: Device = "cpu",
    *,
    prefix: str = "model",
) -> dict[str, torch.Tensor]:
    """Every tensor of the group ``prefix`` (default ``model``), new, on ``device``.

    Keys are the names relative to the group (joined with ``/`` below it); the aliases of
    a tied tensor map to one tensor object, as in ``model.state_dict()``. One batch read.
    """
    with _opened(path) as ckpt:
        return SafeOpen(ckpt, device=device, prefix=prefix).get_tensors()


@contextmanager
def _opened(path: str | os.PathLike[str] | Store | Checkpoint) -> Iterator[Checkpoint]:
    if isinstance(path, Checkpoint):
        yield path
        return
    with open_checkpoint(path) as ckpt:
        yield ckpt


def tensor_names(ckpt: Checkpoint, prefix: str = "model") -> dict[str, str]:
    """Name -> node path of every tensor below the group ``prefix`` (``""``: all), its
    tied aliases included; names are relative to the group, joined with ``/``."""
    group = prefix.strip("/")
    if group and group not in ckpt.groups:
        raise TensorNotFoundError(f"no group {group!r}", path=ckpt.location)
    start = group + "/" if group else ""
    out = {"/".join(names.split_path(node[len(start):])): node
           for node in ckpt.arrays if node.startswith(start)}
    meta = ckpt.groups.get(group)
    aliases = meta.ucp.get("aliases", {}) if meta is not None else {}
    for alias, target in aliases.items() if isinstance(aliases, Mapping) else ():
        if isinstance(target, str) and target in out:
            out[str(alias)] = out[target]  # tied: the stored tensor (UCP-1.0-R108)
    return out


class TensorSlice:
    """One stored tensor, not read yet: index it to read the chunks the slice needs."""

    def __init__(self, opened: SafeOpen, name: str, tensor: Tensor) -> None:
        self._opened = opened
        self.name = name
        self._tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)

    def get_dtype(self) -> str:
        """The UCP data type name (``"bfloat16"``; safetensors says ``"BF16"``)."""
        return self._tensor.meta.dtype.name

    def __getitem__(self, selection: Any) -> Any:
        """Integers, slices (with steps) and ``...``, as numpy indexes them."""
        self._opened.check_open()
        return self._opened.convert(self._tensor[selection], self._tensor.path)

    def __repr__(self) -> str:
        return f"<TensorSlice {self.name!r} shape={self.get_shape()} dtype={self.get_dtype()}>"


class SafeOpen:
    """An open checkpoint seen as a flat mapping of tensors (what :func:`safe_open` gives).

    Opening reads the root metadata only; listing names and shapes reads nothing more.
    ``checkpoint`` is the open :class:`ucpformat.Checkpoint` (its ``stats`` count the
    bytes read).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Store | Checkpoint,
        framework: str = "pt",
        device: Device = "cpu",
        *,
        prefix: str = "model",
    ) -> None:
        if framework not in FRAMEWORKS:
            raise LoadError(f"framework must be one of {sorted(FRAMEWORKS)}, got {framework!r}")
        self._numpy = FRAMEWORKS[framework]
        self._device = _device(device)
        if self._numpy and self._device.type != "cpu":
            raise LoadError(f"numpy arrays live on the CPU, not on {self._device}")
        check_device(self._device)  # the meta device would hold nothing
        self._owned = not isinstance(path, Checkpoint)
        self.checkpoint: Checkpoint = (
            path if isinstance(path, Checkpoint) else open_checkpoint(path))
        self._closed = False
        try:
            self._paths = tensor_names(self.checkpoint, prefix)
        except UCPError:
            self.close()
            raise

    # -- the metadata ---------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every tensor's name, sorted (aliases of tied tensors included)."""
        self.check_open()
        return sorted(self._paths)

    def metadata(self) -> dict[str, Any] | None:
        """The metadata given at save time (None if there was none)."""
        self.check_open()
        return self.checkpoint.metadata or None

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def __len__(self) -> int:
        return len(self._paths)

    # -- tensors --------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        self.check_open()
        path = self._paths.get(name)
        if path is None:
            raise TensorNotFoundError(f"no tensor {name!r}", path=self.checkpoint.location)
        return path

    def get_slice(self, name: str) -> TensorSlice:
        """The tensor ``name``, to index: ``get_slice("w")[:, :16]`` reads what it needs."""
        return TensorSlice(self, name, self.checkpoint[self._path(name)])

    def get_tensor(self, name: str) -> Any:
        """The whole tensor ``name``, new (on the device; a numpy array for numpy)."""
        return self._read([self._path(name)])[0]

    def get_tensors(self) -> dict[str, Any]:
        """Every tensor, read as one batch; tied aliases are one object."""
        self.check_open()
        paths = sorted(set(self._paths.values()))
        by_path = dict(zip(paths, self._read(paths), strict=True))
        return {name: by_path[path] for name, path in sorted(self._paths.items())}

    def _read(self, paths: list[str]) -> list[Any]:
        """The whole tensors at ``paths``, in this framework and on this device. On the
        CPU the arrays read are the tensors' own memory (one batch of reads, no copy), and
        a tensor stored as one uncompressed chunk on a local file system is a view of its
        file mapped copy-on-write, checked first (:meth:`Checkpoint.read_whole`); other
        devices go through the pinned staging of :func:`read_tensors`."""
        if self._numpy or self._device.type == "cpu":
            arrays = self.checkpoint.read_whole(paths, mapped=True)
            if self._numpy:
                return arrays
            return [from_numpy(a, name=p) for p, a in zip(paths, arrays, strict=True)]
        return read_tensors(self.checkpoint,
                            [TensorRead(p, device=self._device) for p in paths]).tensors

    def convert(self, array: np.ndarray[Any, Any], where: str) -> Any:
        """A numpy array read from the checkpoint, in this framework and on this device."""
        return array if self._numpy else from_numpy(array, name=where, device=self._device)

    # -- life cycle -----------------------------------------------------------------------

    def check_open(self) -> None:
        if self._closed:
            raise UCPError("closed: open it again with safe_open",
                           path=self.checkpoint.location)

    def close(self) -> None:
        if self._owned and not self._closed:
            self.checkpoint.close()
        self._closed = True

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} tensors"
        return f"<ucpformat.torch.SafeOpen {self.checkpoint.location!r} {state}>"


def safe_open(
    path: str | os.PathLike[str] | Store | Checkpoint,
    framework: str = "pt",
    device: Device = "cpu",
    *,
    prefix: str = "model",
) -> SafeOpen:
    """Open a checkpoint lazily as a flat mapping of tensors (``with safe_open(...) as f``).

    ``framework``: ``"pt"`` (torch tensors on ``device``; an integer is a CUDA index) or
    ``"numpy"``. Tensors are those below group ``prefix`` (default ``model``).
    """
    return SafeOpen(path, framework, device, prefix=prefix)


__all__ = ["FLAT_CHUNK_BYTES", "FRAMEWORKS", "SafeOpen", "TensorSlice", "load_file",
           "safe_open", "save_file", "tensor_names"]
