"""Capture and restore the random-number generators a training run draws from.

::

    state = ucpt.rng_state()                 # random, numpy.random, torch (CPU, CUDA)
    ucpt.save("ckpt", model=model, rng=True)  # the same, into training/rng
    result = ucpt.load("ckpt", model=model, rng=True)   # restores them (result.rng too)
    ucpt.set_rng_state(result.rng)

Generators a run holds itself (a ``numpy.random.Generator``, a ``torch.Generator``, a
``random.Random``) are named: ``rng_state(generators={"loader": gen})`` captures them,
``set_rng_state(state, generators={"loader": gen})`` restores them. The layout in the
checkpoint is :mod:`ucpformat.checkpoint.rng` (spec UCP-1.0-R085).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ucpformat.checkpoint import rng as layout
from ucpformat.errors import InvalidValueError, KeyMismatchError, LoadError
from ucpformat.torch.load_plan import Step

#: A generator that a run holds itself.
Generator = random.Random | np.random.Generator | np.random.RandomState | torch.Generator


def _state_of(generator: Any, where: str) -> Any:
    if isinstance(generator, random.Random):
        return generator.getstate()
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, np.random.RandomState):
        return generator.get_state(legacy=False)
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    raise InvalidValueError(
        f"a {type(generator).__name__} is not a generator (random.Random, "
        "numpy.random.Generator or RandomState, torch.Generator)", path=where,
    )


def _restore(generator: Any, state: Any, where: str) -> None:
    try:
        if isinstance(generator, random.Random):
            generator.setstate(state)
        elif isinstance(generator, np.random.Generator):
            generator.bit_generator.state = state
        elif isinstance(generator, np.random.RandomState):
            generator.set_state(state)
        elif isinstance(generator, torch.Generator):
            generator.set_state(torch.as_tensor(state).cpu())
        else:
            raise TypeError(f"a {type(generator).__name__} is not a generator")
    except (TypeError, ValueError, RuntimeError) as exc:
        raise LoadError(f"the stored state does not fit this generator: {exc}",
                        path=where) from None


def rng_state(generators: Mapping[str, Generator] | None = None) -> dict[str, Any]:
    """The state of Python's ``random``, NumPy's global generator, torch's CPU generator
    and, where CUDA is available, every CUDA device's generator; plus ``generators``.

    Python's state is the tuple ``random.getstate()`` returns; NumPy's the mapping of
    ``numpy.random.get_state(legacy=False)``; torch's uint8 tensors (``torch_cuda``: a
    list, one per device).
    """
    state: dict[str, Any] = {
        layout.PYTHON: random.getstate(),
        layout.NUMPY: np.random.get_state(legacy=False),
        layout.TORCH_CPU: torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state[layout.TORCH_CUDA] = torch.cuda.get_rng_state_all()
    if generators:
        state[layout.GENERATORS] = {
            name: _state_of(g, f"generators[{name!r}]") for name, g in generators.items()}
    return state


def set_rng_state(
    state: Mapping[str, Any],
    *,
    generators: Mapping[str, Generator] | None = None,
    strict: bool = True,
) -> None:
    """Restore what :func:`rng_state` captured (or a checkpoint's ``LoadResult.rng``).

    Each generator the state holds is restored; ``generators`` receive their named
    states. With ``strict``, CUDA states for devices this process lacks, and a named
    generator the state does not hold, are a ``LoadError`` / ``KeyMismatchError``;
    otherwise they are left out.
    """
    cuda = list(state.get(layout.TORCH_CUDA) or [])
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if strict and len(cuda) > devices:
        raise LoadError(f"the state holds the CUDA generators of {len(cuda)} devices, this "
                        f"process has {devices}; pass strict=False to restore the others",
                        path="training/rng/torch_cuda")
    named = state.get(layout.GENERATORS) or {}
    missing = [n for n in (generators or {}) if n not in named]
    if strict and missing:
        raise KeyMismatchError(f"no stored state for the generators {missing}",
                               path="training/rng/generators")
    if layout.PYTHON in state:
        try:
            random.setstate(state[layout.PYTHON])
        except (TypeError, ValueError) as exc:
            raise LoadError(f"random refuses the stored state: {exc}",
                            path="training/rng/python") from None
    if layout.NUMPY in state:
        try:
            np.random.set_state(state[layout.NUMPY])
        except (TypeError, ValueError, KeyError) as exc:
            raise LoadError(f"numpy refuses the stored state: {exc}",
                            path="training/rng/numpy") from None
    if layout.TORCH_CPU in state:
        torch.set_rng_state(torch.as_tensor(state[layout.TORCH_CPU]).cpu())
    for i, device_state in enumerate(cuda[:devices]):
        torch.cuda.set_rng_state(torch.as_tensor(device_state).cpu(), i)
    for name, generator in (generators or {}).items():
        if name in named:
            _restore(generator, named[name], f"training/rng/generators/{name}")


def to_layout(state: Mapping[str, Any]) -> Any:
    """The ``training/rng`` group of a state (torch tensors as uint8 arrays)."""

    def host(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu().numpy()
        if isinstance(value, Mapping) and "bit_generator" not in value:
            return {k: host(v) for k, v in value.items()}
        if isinstance(value, list):
            return [host(v) for v in value]
        return value

    return layout.encode({k: host(v) for k, v in state.items()})


def from_layout(tree: Mapping[str, Any], *, where: str = "training/rng") -> dict[str, Any]:
    """A state from the checkpoint's ``training/rng`` (``Checkpoint.to_dict``), or from
    another group of that form (``where``: a rank's ``training/ranks/<r>/rng``): torch's
    states as uint8 tensors, the rest as Python and NumPy give them."""

    def tensor(value: Any) -> Any:
        return torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value

    state = layout.decode(tree, where=where)
    if layout.TORCH_CPU in state:
        state[layout.TORCH_CPU] = tensor(state[layout.TORCH_CPU])
    if layout.TORCH_CUDA in state:
        state[layout.TORCH_CUDA] = [tensor(s) for s in state[layout.TORCH_CUDA]]
    if layout.GENERATORS in state:
        state[layout.GENERATORS] = {k: tensor(v) for k, v in state[layout.GENERATORS].items()}
    return state


def rng_step(state: Mapping[str, Any], *, strict: bool, path: str = "training/rng") -> Step:
    """A load's step restoring the generators to ``state`` (stored at ``path``); undone
    by restoring the ones they had."""
    current = rng_state()
    return Step("the random-number generators", path,
                lambda: set_rng_state(state, strict=strict),
                lambda: set_rng_state(current, strict=False))


__all__ = ["Generator", "from_layout", "rng_state", "rng_step", "set_rng_state", "to_layout"]
