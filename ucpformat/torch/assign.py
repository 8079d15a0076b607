"""Loading by assignment (``assign=True``): a model's parameters and buffers are replaced
by new tensors read from the checkpoint, as ``torch.nn.Module.load_state_dict(assign=True)``
replaces them, instead of being copied into.

This is how a model built on the ``meta`` device (shapes and types, no memory) gets its
data: copying into a meta tensor does nothing, so the loads refuse meta targets without
``assign`` (:func:`ucpformat.torch.load_plan.plan_model`). The rules follow torch's:

* the new tensors keep the checkpoint's data type and land on the load's ``map_location``;
  a parameter stays a ``Parameter`` and keeps its ``requires_grad``, a buffer stays a
  buffer (persistent or not);
* the model's own ``load_state_dict(..., assign=True)`` makes the change, so its hooks
  run (FSDP2 re-registers its sharded parameters there);
* an optimizer must be built after the load: it would hold the replaced parameters.

Unlike torch's (which gives each name its own new ``Parameter``), tied names stay tied:
every name of one live tensor receives one and the same new object. With torch's
``swap_module_params_on_conversion`` on, torch swaps the new data into the live objects
themselves; each object is then given once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucpformat.errors import LoadError
from ucpformat.torch.load_plan import Step


@dataclass(frozen=True)
class AssignGroup:
    """State-dict names that receive one new tensor, read from node ``path``."""

    path: str
    #: The names, in state-dict order (several for a tied tensor).
    names: tuple[str, ...]
    #: The tensor the names hold now (None: an entry made by a state-dict hook).
    live: torch.Tensor | None


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under every one of its names."""
    live: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    live.update(model.named_buffers(remove_duplicate=False))
    return live


def assign_groups(
    live: Mapping[str, torch.Tensor], tensors: Mapping[str, str]
) -> list[AssignGroup]:
    """The new tensors an assign load makes for ``tensors`` (state-dict name -> node path):
    one per live tensor object, given to all of its names (the first name's stored tensor:
    where a tied tensor is stored once, every name maps to it anyway), and one per name
    that is no live tensor's."""
    order: dict[int, int] = {}
    groups: list[tuple[str, list[str], torch.Tensor | None]] = []
    for name, path in tensors.items():
        obj = live.get(name)
        if obj is None:
            groups.append((path, [name], None))
        elif id(obj) in order:
            groups[order[id(obj)]][1].append(name)
        else:
            order[id(obj)] = len(groups)
            groups.append((path, [name], obj))
    return [AssignGroup(path, tuple(names), obj) for path, names, obj in groups]


def assigned(group: AssignGroup, tensor: torch.Tensor) -> torch.Tensor:
    """What the group's names receive: a new ``Parameter`` with the live one's
    ``requires_grad`` where a parameter is, ``tensor`` itself otherwise."""
    if isinstance(group.live, torch.nn.Parameter):
        return torch.nn.Parameter(tensor, requires_grad=group.live.requires_grad)
    return tensor


def assigned_state(
    groups: Sequence[AssignGroup],
    tensors: Sequence[torch.Tensor],
    rename: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, torch.Tensor]:
    """The state dict that assigns ``tensors`` (one per group, read from its path) to the
    groups' names (``rename``: each name's keys in the model's own ``load_state_dict``,
    if they differ)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    state: dict[str, torch.Tensor] = {}
    for group, tensor in zip(groups, tensors, strict=True):
        value = assigned(group, tensor)
        # swapping puts the data into the live object itself: its other names follow
        names = group.names[:1] if swap and group.live is not None else group.names
        for name in names:
            for key in (rename or {}).get(name, (name,)):
                state[key] = value
    return state


def still_on_meta(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s parameters and buffers on the meta device (no data)."""
    return [name for name, t in live_tensors(model).items() if t.is_meta]


def assign_step(model: torch.nn.Module, state: Mapping[str, Any]) -> Step:
    """Loading ``state`` into ``model`` by assignment (``model.load_state_dict(state,
    strict=False, assign=True)``); a tensor that is then still on the meta device (a
    module whose own loading copies instead of assigning) is an error."""

    def apply() -> None:
        model.load_state_dict(state, strict=False, assign=True)
        live = live_tensors(model)
        left = [k for k, v in state.items()
                if isinstance(v, torch.Tensor) and k in live and live[k].is_meta]
        if left:
            raise LoadError(
                f"{left[0]!r} is still on the meta device after load_state_dict(assign=True): "
                "its module copies instead of assigning", tensor=left[0],
            )

    return Step("the model", "model", apply)


__all__ = [
    "AssignGroup",
    "assign_groups",
    "assign_step",
    "assigned",
    "assigned_state",
    "live_tensors",
    "still_on_meta",
]
