"""Each process's own state in ``training/ranks/<rank>`` (spec UCP-1.0-R086, UCP-1.0-R087).

A run of N processes keeps state that differs between them and that no consolidated
tensor holds: each process's random-number generators, the position of its data loader,
any ``Stateful`` object of its own. The layout::

    training/ranks                 group, values {"world_size": N}
    training/ranks/<r>             group: rank r's state (JSON values, arrays, groups)
    training/ranks/<r>/rng         group in the form of training/rng (UCP-1.0-R085)

:func:`encode` makes the group for one process that writes every rank's state (a
trainer whose rank 0 saves alone); a distributed save gives each rank's part from that
rank (:func:`ucpformat.torch.save_distributed`). :func:`read` is what a loader of rank r
reads: its own group and the saved world size, never another rank's state. The rule at
another world size (UCP-1.0-R087): rank r takes ``training/ranks/<r>`` where it exists;
otherwise it keeps its own state and the loader says so (:class:`RankStateWarning`).
:func:`problems` lists what breaks UCP-1.0-R086, for the validator.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ucpformat.checkpoint import rng as rng_layout
from ucpformat.checkpoint.tree import Group
from ucpformat.errors import InvalidValueError
from ucpformat.format import names

if TYPE_CHECKING:
    from ucpformat.checkpoint.reader import Checkpoint

RULE = "UCP-1.0-R086"
LOAD_RULE = "UCP-1.0-R087"
#: The group of per-rank state, and the name of a rank's generators inside its group.
GROUP = "training/ranks"
RNG = "rng"
WORLD_SIZE = "world_size"
_RANK = re.compile(r"^(0|[1-9][0-9]*)$")


class RankStateWarning(UserWarning):
    """A load restored per-rank state incompletely: this rank found none of its own, or
    the checkpoint was written by another number of processes (UCP-1.0-R087)."""


def rank_path(rank: int) -> str:
    """The node path of rank ``rank``'s group: ``training/ranks/<rank>``."""
    return f"{GROUP}/{check_rank(rank, None)}"


def check_rank(rank: int, world_size: int | None) -> int:
    """``rank`` if it is a rank (an integer from 0, below ``world_size`` when given)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 or (
            world_size is not None and rank >= world_size):
        raise InvalidValueError(
            f"rank {rank!r} is not a rank of a run of {world_size} processes"
            if world_size is not None else f"rank {rank!r} is not a rank (0, 1, ...)",
            rule=RULE, path=GROUP)
    return rank


def group_values(world_size: int) -> dict[str, Any]:
    """The values of ``training/ranks`` (``ranks.schema.json``)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidValueError(f"world_size {world_size!r} is not a positive integer",
                                rule=RULE, path=GROUP)
    return {WORLD_SIZE: world_size}


def encode(world_size: int, states: Mapping[int, Mapping[str, Any]]) -> Group:
    """The group ``training/ranks`` for the state of every rank, written by one process:
    ``states[r]`` is rank r's mapping of names to arrays, JSON values and mappings, whose
    ``rng`` entry, if any, is a generators' state in the form :func:`rng.encode` takes.
    Ranks without state may be left out."""
    out = Group(group_values(world_size))
    for rank, state in sorted(states.items()):
        check_rank(rank, world_size)
        out[str(rank)] = rank_group(state, rank)
    return out


def rank_group(state: Mapping[str, Any], rank: int) -> Group:
    """Rank ``rank``'s group: ``state`` with its ``rng`` entry encoded (UCP-1.0-R085)."""
    where = rank_path(rank)
    group = Group()
    for key, value in state.items():
        if not isinstance(key, str) or not key:
            raise InvalidValueError(f"per-rank state is named by non-empty strings, got "
                                    f"{key!r}", path=where)
        group[key] = rng_layout.encode(value, where=f"{where}/{RNG}") if key == RNG else value
    return group


@dataclass(frozen=True)
class RankState:
    """What a checkpoint holds for one rank (:func:`read`)."""

    rank: int
    #: The number of processes of the run that wrote the per-rank state; None where the
    #: checkpoint has no ``training/ranks``.
    world_size: int | None
    #: Rank ``rank``'s state as ``Checkpoint.to_dict`` reads it (arrays as numpy), or None
    #: where the checkpoint holds none for it.
    state: dict[str, Any] | None

    def warn(self, world_size: int, *, stacklevel: int = 3) -> list[str]:
        """Say (:class:`RankStateWarning`) what a load into a run of ``world_size``
        processes could not restore exactly (UCP-1.0-R087), and return what it said;
        silent where nothing is amiss."""
        messages = self.shortfalls(world_size)
        for message in messages:
            warnings.warn(message, RankStateWarning, stacklevel=stacklevel)
        return messages

    def shortfalls(self, world_size: int) -> list[str]:
        """What :meth:`warn` says, as messages."""
        out: list[str] = []
        if self.state is None:
            out.append(
                f"rank {self.rank} finds no state of its own in the checkpoint "
                f"({rank_path(self.rank)}"
                + (f"; it was written by {_processes(self.world_size)}" if self.world_size
                   else "; it holds no per-rank state")
                + f"): this rank keeps its own generators and data position ({LOAD_RULE})")
        if self.world_size is not None and self.world_size != world_size:
            out.append(
                f"the checkpoint's per-rank state is that of {_processes(self.world_size)} "
                f"and this run has {world_size}: each rank that finds its own takes it, but the "
                f"data order and random draws differ from a run that did not stop "
                f"({LOAD_RULE})")
        return out


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def read(ckpt: Checkpoint, rank: int) -> RankState:
    """Rank ``rank``'s state and the saved world size; only that rank's group is read."""
    check_rank(rank, None)
    if GROUP not in ckpt.groups:
        return RankState(rank, None, None)
    size = ckpt.values(GROUP).get(WORLD_SIZE)
    world_size = size if isinstance(size, int) and not isinstance(size, bool) else None
    path = rank_path(rank)
    state = ckpt.to_dict(path) if path in ckpt.groups else None
    return RankState(rank, world_size, state)


def problems(values: Mapping[str, Any], children: Mapping[str, bool]) -> list[tuple[str, str]]:
    """(path, problem) of what breaks UCP-1.0-R086 in ``training/ranks``, given its values
    and its children (node name -> whether it is a group). The schema checks the values;
    this checks the children against them. A rank's ``rng`` is checked as
    ``training/rng`` is (UCP-1.0-R085), by the caller."""
    out: list[tuple[str, str]] = []
    size = values.get(WORLD_SIZE)
    world_size = size if isinstance(size, int) and not isinstance(size, bool) else None
    for name, is_group in sorted(children.items()):
        path = f"{GROUP}/{names.escape(name)}"
        if not _RANK.match(name):
            out.append((path, f"{name!r} is not a rank (0, 1, ... in decimal, no leading "
                              "zero)"))
        elif world_size is not None and int(name) >= world_size:
            out.append((path, f"rank {name} of a run of {world_size} processes"))
        if not is_group:
            out.append((path, "a rank's state is a group, not an array"))
    return out


__all__ = [
    "GROUP",
    "LOAD_RULE",
    "RNG",
    "RULE",
    "WORLD_SIZE",
    "RankState",
    "RankStateWarning",
    "check_rank",
    "encode",
    "group_values",
    "problems",
    "rank_group",
    "rank_path",
    "read",
]
