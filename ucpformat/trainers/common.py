"""What the trainer integrations share: per-rank generators, a trainer's own state as
JSON, and the check of a trainer's version against the tested range.

Per-rank generators (``training/rank_rng/<rank>``): ``training/rng`` (UCP-1.0-R085)
holds one process's generators, while a resumed run of N ranks needs each rank's own
(dropout differs per rank). Each rank's group holds ``torch_cpu`` (uint8, torch's CPU
generator), ``torch_cuda.<i>`` (uint8, where CUDA is available), ``python_state`` and
``numpy_key`` (uint32: the 625 integers of ``random.getstate()`` and NumPy's MT19937
key) and the JSON values ``python_version``, ``python_gauss_next``,
``numpy_bit_generator``, ``numpy_pos``, ``numpy_has_gauss`` and ``numpy_gauss``.

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

from ucpformat.checkpoint.commit import delete_checkpoint
from ucpformat.errors import FormatError, InvalidValueError, StorageError
from ucpformat.store import open_store

#: The ``extra`` / ``training`` key of the per-rank generators.
RANK_RNG = "rank_rng"
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


def rank_rng_extra(ranks: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The ``extra`` (``training/``) entries that store every rank's generators
    (``{"<rank>": rng_state(...)}``, as :func:`gathered_rng` gives them)."""
    return {RANK_RNG: {str(r): dict(state) for r, state in ranks.items()}}


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


def restore_rng(training: Mapping[str, Any], rank: int, world: int) -> None:
    """Set this process's generators from ``training/rank_rng/<rank>`` (a load's
    ``LoadResult.training``). A checkpoint with no state for this rank, or saved by
    another number of ranks, is a warning: the run goes on, not bit-equal to one that
    did not stop."""
    ranks = training.get(RANK_RNG)
    if not isinstance(ranks, Mapping) or str(rank) not in ranks:
        warnings.warn(
            f"the checkpoint holds no generator state for rank {rank} (training/{RANK_RNG}"
            f"/{rank}); this rank keeps its own generators", UserWarning, stacklevel=2)
        return
    if len(ranks) != world:
        warnings.warn(
            f"the checkpoint holds the generators of {len(ranks)} ranks and this run has "
            f"{world}: rank {rank} takes rank {rank}'s, but the data order and dropout "
            "differ from a run that did not stop", UserWarning, stacklevel=2)
    state = ranks[str(rank)]
    where = f"training/{RANK_RNG}/{rank}"
    try:
        py_state = tuple(int(i) for i in _array(state["python_state"]).tolist())
        gauss = state["python_gauss_next"]
        np_state = {"bit_generator": state["numpy_bit_generator"],
                    "state": {"key": _array(state["numpy_key"]).astype(np.uint32),
                              "pos": int(state["numpy_pos"])},
                    "has_gauss": int(state["numpy_has_gauss"]),
                    "gauss": float(state["numpy_gauss"])}
        cpu = torch.as_tensor(_array(state["torch_cpu"])).to(torch.uint8)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"not the per-rank generator state ucpformat writes: {exc}",
                          path=where) from None
    random.setstate((int(state["python_version"]), py_state,
                     None if gauss is None else float(gauss)))
    np.random.set_state(np_state)
    torch.set_rng_state(cpu)
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            saved = state.get(f"torch_cuda.{i}")
            if saved is not None:
                torch.cuda.set_rng_state(torch.as_tensor(_array(saved)).to(torch.uint8), i)


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


__all__ = ["RANK_RNG", "UntestedVersionWarning", "check_version", "decode_state",
           "encode_state", "gathered_rng", "own_rng", "rank0_view", "rank_rng_extra", "remove",
           "restore_rng", "rng_state"]
