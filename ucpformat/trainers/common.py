"""What the trainer integrations share: per-rank generators, a trainer's own state as
JSON, and the check of a trainer's version against the tested range.

Per-rank generators: a resumed run of N ranks needs each rank's own (dropout and
shuffling differ per rank). They are stored in the spec's per-rank convention
(UCP-1.0-R086): ``training/ranks/<rank>/rng``, each in the form of ``training/rng``
(UCP-1.0-R085), with ``world_size`` in the values of ``training/ranks``. In memory and on
the wire between ranks (JSON, never pickle) a rank's generators are a flat mapping
(:func:`own_rng`): ``torch_cpu`` (uint8), ``torch_cuda.<i>`` (uint8, where CUDA is
available), ``python_state`` and ``numpy_key`` (uint32: the 625 integers of
``random.getstate()`` and NumPy's MT19937 key) and the JSON values ``python_version``,
``python_gauss_next``, ``numpy_bit_generator``, ``numpy_pos``, ``numpy_has_gauss`` and
``numpy_gauss``. :func:`rank_rng_extra` turns the gathered mappings into the stored
group; :func:`restore_rng` gives a rank its own back (UCP-1.0-R087).

A trainer's own state (Lightning's loops and callbacks, ``trainer_state.json``) is one
JSON value: a list of ``[key, value]`` pairs in the trainer's order, in which what JSON
lacks is tagged: a tensor ``{"__tensor__": values, "dtype": "float32"}``, a tuple
``{"__tuple__": [...]}``, a non-finite float ``{"__float__": "inf"}``, a mapping with
keys other than strings ``{"__pairs__": [[key, value], ...]}``. Anything else is
refused, naming where it is.
"""

from __future__ import annotations

import math
import os
import random
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ucpformat
from ucpformat.checkpoint import rank_state
from ucpformat.checkpoint.commit import delete_checkpoint
from ucpformat.checkpoint.reader import Checkpoint
from ucpformat.errors import FormatError, InvalidValueError, StorageError
from ucpformat.store import open_store
from ucpformat.torch.rng import from_layout as rng_from_layout
from ucpformat.torch.rng import set_rng_state

#: The ``extra`` / ``training`` key of the per-rank state (``training/ranks``).
RANKS = rank_state.GROUP.split("/")[1]
_TAGS = ("__tensor__", "__tuple__", "__float__", "__pairs__")


class UntestedVersionWarning(UserWarning):
    """A trainer's installed version is outside the range its integration was tested with."""


def check_version(package: str, version: str, tested: tuple[tuple[int, int], tuple[int, int]]
                  ) -> None:
    """Warn (:class:`UntestedVersionWarning`) naming ``package`` and ``version`` when its
    major.minor is outside ``tested`` (first and last tested major.minor, inclusive)."""
    try:
        found = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        found = ()
    low, high = tested
    if len(found) != 2 or not low <= found <= high:
        warnings.warn(
            f"{package} {version} is outside the versions ucpformat's integration was tested "
            f"with ({low[0]}.{low[1]} to {high[0]}.{high[1]}.x); see docs/trainers.md",
            UntestedVersionWarning, stacklevel=3)


def remove(path: str | os.PathLike[str]) -> None:
    """Delete the UCP checkpoint at ``path`` (its root metadata first, UCP-1.0-R053) and
    then its empty directory; a file, or a directory that is not a checkpoint, is
    refused and left as it is."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise StorageError("not a UCP checkpoint (a file, not a directory); left as it is",
                           path=path)
    delete_checkpoint(open_store(path))
    os.rmdir(path)


# -- per-rank generators -----------------------------------------------------------------


def own_rng() -> dict[str, Any]:
    """This process's generators in the per-rank form (tensors and JSON values)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return rng_state(random.getstate(), np.random.get_state(legacy=False),
                     torch.get_rng_state(), cuda)


def rng_state(python: Any, numpy: Any, torch_cpu: torch.Tensor,
              cuda: Sequence[torch.Tensor] = (), *, where: str = "generator state"
              ) -> dict[str, Any]:
    """One process's generators in the per-rank form, from the states as
    ``random.getstate()``, ``np.random.get_state()`` (the legacy tuple or the dict),
    ``torch.get_rng_state()`` and ``torch.cuda.get_rng_state_all()`` give them (a
    checkpoint of another trainer holding them; ``where`` names it in errors)."""
    try:
        version, py_state, gauss_next = python
        if isinstance(numpy, Mapping):
            bit_generator, key = numpy["bit_generator"], numpy["state"]["key"]
            pos, has_gauss, gauss = numpy["state"]["pos"], numpy["has_gauss"], numpy["gauss"]
        else:
            bit_generator, key, pos, has_gauss, gauss = numpy
        out: dict[str, Any] = {
            "torch_cpu": torch.as_tensor(torch_cpu).to(torch.uint8),
            "python_state": torch.from_numpy(np.asarray(py_state, dtype=np.uint32)),
            "python_version": int(version),
            "python_gauss_next": None if gauss_next is None else float(gauss_next),
            "numpy_key": torch.from_numpy(np.asarray(key, dtype=np.uint32)),
            "numpy_bit_generator": str(bit_generator),
            "numpy_pos": int(pos),
            "numpy_has_gauss": int(has_gauss),
            "numpy_gauss": float(gauss),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"not the states of Python's, NumPy's and torch's generators: {exc}",
                          path=where) from None
    if len(out["python_state"]) != 625 or len(out["numpy_key"]) != 624:
        raise FormatError("not the states of Python's and NumPy's Mersenne twisters (625 "
                          "and 624 integers)", path=where)
    for i, state in enumerate(cuda):
        out[f"torch_cuda.{i}"] = torch.as_tensor(state).to(torch.uint8)
    return out


def rank_rng_extra(ranks: Mapping[str, Mapping[str, Any]], world_size: int | None = None
                   ) -> dict[str, Any]:
    """The ``extra`` (``training/``) entry that stores every rank's generators
    (``{"<rank>": rng_state(...)}``, as :func:`gathered_rng` gives them) in
    ``training/ranks/<rank>/rng`` (UCP-1.0-R086); ``world_size``: the run's number of
    processes (default: one per entry)."""
    states = {int(r): {rank_state.RNG: _layout_form(state, f"{rank_state.GROUP}/{r}")}
              for r, state in ranks.items()}
    return {RANKS: rank_state.encode(len(ranks) if world_size is None else world_size,
                                     states)}


def _layout_form(state: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A rank's flat generator mapping in the form ``training/rng`` takes (UCP-1.0-R085):
    ``python``, ``numpy``, ``torch_cpu`` and ``torch_cuda`` as numpy and Python values."""
    try:
        out: dict[str, Any] = {
            "python": (int(state["python_version"]),
                       tuple(int(i) for i in _array(state["python_state"]).tolist()),
                       state["python_gauss_next"]),
            "numpy": {"bit_generator": str(state["numpy_bit_generator"]),
                      "state": {"key": _array(state["numpy_key"]).astype(np.uint32),
                                "pos": int(state["numpy_pos"])},
                      "has_gauss": int(state["numpy_has_gauss"]),
                      "gauss": float(state["numpy_gauss"])},
            "torch_cpu": _array(state["torch_cpu"]).astype(np.uint8),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"not a rank's generator state as own_rng() gives it: {exc}",
                          path=where) from None
    cuda = sorted((int(k.split(".", 1)[1]), v) for k, v in state.items()
                  if k.startswith("torch_cuda."))
    if cuda:
        out["torch_cuda"] = [_array(v).astype(np.uint8) for _, v in cuda]
    return out


def gathered_rng() -> dict[str, Any]:
    """Every rank's generators, ``{"<rank>": own_rng()}``: collective where
    torch.distributed is initialised (every rank gets all), else this process's only."""
    own = own_rng()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {"0": own}
    # JSON on the wire (never pickle): tensors as their dtype and values
    from ucpformat.torch.comm import TorchCommunicator

    wire = {k: {"dtype": str(v.dtype).removeprefix("torch."), "values": v.tolist()}
            if isinstance(v, torch.Tensor) else v for k, v in own.items()}
    everyone = TorchCommunicator().allgather(wire)
    return {str(r): {k: torch.tensor(v["values"], dtype=getattr(torch, v["dtype"]))
                     if isinstance(v, dict) else v for k, v in state.items()}
            for r, state in enumerate(everyone)}


def rank0_view(value: Any) -> Any:
    """Rank 0's ``value`` (JSON) on every rank, where torch.distributed is initialised:
    a trainer's own state as its stock checkpoint holds it (written by rank 0), stored
    once for all ranks (whose views differ in ``is_world_process_zero`` and the like)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    from ucpformat.torch.comm import TorchCommunicator

    return TorchCommunicator().allgather(value)[0]


def restore_rng(source: Mapping[str, Any] | str | os.PathLike[str] | Checkpoint, rank: int,
                world: int) -> None:
    """Set this process's generators from ``training/ranks/<rank>/rng`` (UCP-1.0-R087):
    ``source`` is a checkpoint (or its path; only this rank's group is read) or a load's
    ``training`` mapping. A checkpoint with no state for this rank, or saved by another
    number of ranks, is a :class:`~ucpformat.checkpoint.rank_state.RankStateWarning`:
    the run goes on, not bit-equal to one that did not stop."""
    if isinstance(source, Mapping):
        ranks = source.get(RANKS)
        ranks = ranks if isinstance(ranks, Mapping) else {}
        size = ranks.get(rank_state.WORLD_SIZE)
        own = ranks.get(str(rank))
        found = rank_state.RankState(rank, size if isinstance(size, int) else None,
                                     _to_numpy(own) if isinstance(own, Mapping) else None)
    elif isinstance(source, Checkpoint):
        found = rank_state.read(source, rank)
    else:
        with ucpformat.open(source) as ckpt:
            found = rank_state.read(ckpt, rank)
    found.warn(world)
    where = f"{rank_state.rank_path(rank)}/{rank_state.RNG}"
    if found.state is None:
        return
    if not isinstance(found.state.get(rank_state.RNG), Mapping):
        warnings.warn(f"rank {rank}'s state holds no generators ({where}); this rank keeps "
                      "its own", rank_state.RankStateWarning, stacklevel=2)
        return
    set_rng_state(rng_from_layout(found.state[rank_state.RNG], where=where), strict=False)


def set_own_rng(state: Mapping[str, Any], *, where: str = "generator state") -> None:
    """Set this process's generators from the flat mapping :func:`own_rng` gives."""
    layout = _layout_form(state, where)
    cuda = layout.pop("torch_cuda", [])
    set_rng_state({**layout, "torch_cpu": torch.from_numpy(layout["torch_cpu"]),
                   "torch_cuda": [torch.from_numpy(c) for c in cuda]}, strict=False)


def _to_numpy(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Tensors in a tree of mappings (a load's ``training``) made numpy arrays."""
    return {k: _to_numpy(v) if isinstance(v, Mapping)
            else _array(v) if isinstance(v, torch.Tensor) else v for k, v in tree.items()}


def _array(value: Any) -> np.ndarray[Any, Any]:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


# -- a trainer's own state as JSON -----------------------------------------------------------


def encode_state(state: Mapping[str, Any], *, where: str) -> list[Any]:
    """A trainer's state mapping as one JSON value: ``[[key, value], ...]`` (tagged JSON)."""
    return [[str(k), _encode(v, f"{where}.{k}")] for k, v in state.items()]


def decode_state(value: Any, *, where: str) -> dict[str, Any]:
    """The mapping :func:`encode_state` stored."""
    if not isinstance(value, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in value):
        raise FormatError("not a list of [key, value] pairs (a trainer's state as ucpformat "
                          "writes it)", path=where)
    return {k: _decode(v, f"{where}.{k}") for k, v in value}


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": _encode(value.detach().cpu().tolist(), where),
                "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: _encode(v, f"{where}.{k}") for k, v in value.items()}
        return {"__pairs__": [[_encode(k, f"{where} key"), _encode(v, f"{where}.{k}")]
                              for k, v in value.items()]}
    raise InvalidValueError(
        f"a {type(value).__module__}.{type(value).__qualname__} cannot be stored as JSON "
        "(trainer state holds numbers, strings, lists, mappings and tensors)", path=where)


def _decode(value: Any, where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, where) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        dtype = getattr(torch, str(value.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise FormatError(f"unknown tensor dtype {value.get('dtype')!r}", path=where)
        return torch.tensor(_decode(value["__tensor__"], where), dtype=dtype)
    if "__tuple__" in value:
        return tuple(_decode(v, where) for v in value["__tuple__"])
    if "__float__" in value:
        return float(value["__float__"])
    if "__pairs__" in value:
        return {_hashable(_decode(k, where)): _decode(v, where) for k, v in value["__pairs__"]}
    return {k: _decode(v, f"{where}.{k}") for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


__all__ = ["RANKS", "UntestedVersionWarning", "check_version", "decode_state",
           "encode_state", "gathered_rng", "own_rng", "rank0_view", "rank_rng_extra", "remove",
           "restore_rng", "rng_state", "set_own_rng"]
