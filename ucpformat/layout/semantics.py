"""Layout semantics of one tensor: how its consolidated form maps onto parallel layouts.

Stored as ``attributes.ucp.layout`` of the array (spec chapter "Layout semantics",
requirements UCP-1.0-R100 and up). Everything here is a fact about the model, not about
a framework: which dimension tensor parallelism splits, fused parts and their sizes,
which dimension is the vocabulary (stored unpadded), experts, the global layer index.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ucpformat.errors import LayoutError

PART_MAJOR = "part-major"
GROUP_MAJOR = "group-major"
FUSED_ORDERS = (PART_MAJOR, GROUP_MAJOR)


@dataclass(frozen=True)
class Part:
    """One fused sub-parameter: a named run of ``size`` rows along the split dimension."""

    name: str
    size: int


@dataclass(frozen=True)
class TensorLayout:
    """Layout semantics of one consolidated tensor (all optional; empty = replicated)."""

    tp_dim: int | None = None
    parts: tuple[Part, ...] = ()
    groups: int | None = None
    vocab_dim: int | None = None
    experts_dim: int | None = None
    experts_count: int | None = None
    expert: int | None = None
    layer: int | None = None
    layers_dim: int | None = None
    layers_count: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def replicated(self) -> bool:
        return self.tp_dim is None

    def part_offsets(self) -> list[tuple[Part, int]]:
        out, off = [], 0
        for p in self.parts:
            out.append((p, off))
            off += p.size
        return out

    # -- JSON ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = dict(self.extra)
        if self.tp_dim is not None:
            doc["tp"] = {"dim": self.tp_dim}
        if self.parts:
            doc["parts"] = [{"name": p.name, "size": p.size} for p in self.parts]
        if self.groups is not None:
            doc["groups"] = self.groups
        if self.vocab_dim is not None:
            doc["vocab"] = {"dim": self.vocab_dim}
        if self.experts_dim is not None:
            doc["experts"] = {"dim": self.experts_dim, "count": self.experts_count}
        if self.expert is not None:
            doc["expert"] = self.expert
        if self.layer is not None:
            doc["layer"] = self.layer
        if self.layers_dim is not None:
            doc["layers"] = {"dim": self.layers_dim, "count": self.layers_count}
        return doc

    @staticmethod
    def from_json(doc: Any, *, tensor: str | None = None) -> TensorLayout:
        """Parse ``attributes.ucp.layout`` (types only; see :func:`check` for the shape)."""

        def bad(msg: str, rule: str = "UCP-1.0-R100") -> LayoutError:
            return LayoutError(msg, rule=rule, tensor=tensor)

        if not isinstance(doc, Mapping):
            raise bad("layout must be an object")

        def nat(v: Any, what: str, *, positive: bool = False) -> int:
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if positive else 0):
                raise bad(
                    f"{what} must be a {'positive' if positive else 'non-negative'} integer, "
                    f"got {v!r}"
                )
            return v

        def dim_of(key: str) -> int | None:
            obj = doc.get(key)
            if obj is None:
                return None
            if not isinstance(obj, Mapping) or "dim" not in obj:
                raise bad(f"{key} must be an object with 'dim'")
            return nat(obj["dim"], f"{key}.dim")

        known = {"tp", "parts", "groups", "vocab", "experts", "expert", "layer", "layers"}
        parts_doc = doc.get("parts", [])
        if not isinstance(parts_doc, list):
            raise bad("parts must be a list")
        parts = []
        for p in parts_doc:
            if not isinstance(p, Mapping) or not isinstance(p.get("name"), str):
                raise bad("each part needs a name (string) and a size")
            parts.append(
                Part(p["name"], nat(p.get("size"), f"part {p['name']!r} size", positive=True))
            )
        experts = doc.get("experts")
        layers = doc.get("layers")
        return TensorLayout(
            tp_dim=dim_of("tp"),
            parts=tuple(parts),
            groups=None
            if doc.get("groups") is None
            else nat(doc["groups"], "groups", positive=True),
            vocab_dim=dim_of("vocab"),
            experts_dim=dim_of("experts"),
            experts_count=None
            if experts is None
            else nat(
                experts.get("count") if isinstance(experts, Mapping) else None,
                "experts.count",
                positive=True,
            ),
            expert=None if doc.get("expert") is None else nat(doc["expert"], "expert"),
            layer=None if doc.get("layer") is None else nat(doc["layer"], "layer"),
            layers_dim=dim_of("layers"),
            layers_count=None
            if layers is None
            else nat(
                layers.get("count") if isinstance(layers, Mapping) else None,
                "layers.count",
                positive=True,
            ),
            extra={k: v for k, v in doc.items() if k not in known},
        )

    # -- consistency with the array ------------------------------------------------------

    def check(self, shape: Sequence[int], *, tensor: str | None = None) -> None:
        """Refuse layout semantics that contradict the array's shape (UCP-1.0-R101 to
        UCP-1.0-R107)."""
        ndim = len(shape)

        def in_range(d: int | None, what: str, rule: str) -> None:
            if d is not None and not 0 <= d < ndim:
                raise LayoutError(
                    f"{what} {d} is out of range for a tensor of rank {ndim} (shape {list(shape)})",
                    rule=rule,
                    tensor=tensor,
                )

        in_range(self.tp_dim, "tp.dim", "UCP-1.0-R101")
        in_range(self.vocab_dim, "vocab.dim", "UCP-1.0-R104")
        in_range(self.experts_dim, "experts.dim", "UCP-1.0-R105")
        in_range(self.layers_dim, "layers.dim", "UCP-1.0-R106")
        if self.parts:
            if self.tp_dim is None:
                raise LayoutError(
                    "fused parts need a tensor-parallel dimension (tp.dim)",
                    rule="UCP-1.0-R102",
                    tensor=tensor,
                )
            total = sum(p.size for p in self.parts)
            if total != shape[self.tp_dim]:
                raise LayoutError(
                    f"fused parts {[(p.name, p.size) for p in self.parts]} sum to {total}, but "
                    f"dimension {self.tp_dim} has size {shape[self.tp_dim]}",
                    rule="UCP-1.0-R102",
                    tensor=tensor,
                )
            if len({p.name for p in self.parts}) != len(self.parts):
                raise LayoutError(
                    "fused part names must be unique", rule="UCP-1.0-R102", tensor=tensor
                )
        if self.groups is not None:
            if not self.parts:
                raise LayoutError("groups need fused parts", rule="UCP-1.0-R103", tensor=tensor)
            for p in self.parts:
                if p.size % self.groups:
                    raise LayoutError(
                        f"part {p.name!r} of size {p.size} does not divide into "
                        f"{self.groups} groups",
                        rule="UCP-1.0-R103",
                        tensor=tensor,
                    )
        if self.experts_dim is not None and self.experts_count != shape[self.experts_dim]:
            raise LayoutError(
                f"experts.count is {self.experts_count} but dimension {self.experts_dim} has "
                f"size {shape[self.experts_dim]}",
                rule="UCP-1.0-R105",
                tensor=tensor,
            )
        if self.expert is not None and self.experts_dim is not None:
            raise LayoutError(
                "a tensor is either one expert's or stacks experts, not both",
                rule="UCP-1.0-R105",
                tensor=tensor,
            )
        if self.layers_dim is not None and self.layers_count != shape[self.layers_dim]:
            raise LayoutError(
                f"layers.count is {self.layers_count} but dimension {self.layers_dim} has "
                f"size {shape[self.layers_dim]}",
                rule="UCP-1.0-R106",
                tensor=tensor,
            )
        if self.layer is not None and self.layers_dim is not None:
            raise LayoutError(
                "a tensor has one layer index or stacks layers, not both",
                rule="UCP-1.0-R106",
                tensor=tensor,
            )
        used = [d for d in (self.tp_dim, self.experts_dim, self.layers_dim) if d is not None]
        if len(used) != len(set(used)):
            raise LayoutError(
                "tp, experts and layers must split different dimensions",
                rule="UCP-1.0-R107",
                tensor=tensor,
            )
        if self.vocab_dim is not None and self.tp_dim is not None and self.vocab_dim != self.tp_dim:
            raise LayoutError(
                "the vocabulary dimension, when split, must be the tp dimension",
                rule="UCP-1.0-R104",
                tensor=tensor,
            )


def layout_of(
    attributes: Mapping[str, Any], shape: Sequence[int], *, tensor: str | None = None
) -> TensorLayout:
    """The checked layout of an array from its ``attributes.ucp`` (replicated if absent)."""
    doc = attributes.get("layout")
    if doc is None:
        return TensorLayout()
    layout = TensorLayout.from_json(doc, tensor=tensor)
    layout.check(shape, tensor=tensor)
    return layout
