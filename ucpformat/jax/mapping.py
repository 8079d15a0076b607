"""Key maps between Flax's parameter names and axes and PyTorch's.

A Flax ``Dense`` kernel is (in, out); a torch ``Linear`` weight is (out, in). A
checkpoint stores each tensor as the framework that named it laid it out (the format
gives a tensor's axes no meaning), so a JAX save with a key map writes exactly what a
torch save of the same model writes, and a JAX load with it reads a torch save:
every value is bit-equal, only its axes are permuted. The map is the same for save and
load (:class:`~ucpformat.jax.tree.Rename`: the stored name and the permutation).

:func:`torch_keymap` builds it from Flax's conventions:

==============================  ==================  =====================
Flax leaf (``<module>.<leaf>``)  torch name          stored axes
==============================  ==================  =====================
``kernel`` (2-d, ``Dense``)      ``<module>.weight``  (out, in): ``(1, 0)``
``kernel`` (N-d conv, HW..IO)    ``<module>.weight``  (O, I, H, W..): ``(N-1, N-2, 0, 1, ..)``
``bias``                         ``<module>.bias``    as is
``embedding`` (``Embed``)        ``<module>.weight``  as is
``scale`` (``LayerNorm``)        ``<module>.weight``  as is
==============================  ==================  =====================

``modules`` renames module paths (``{"Dense_0": "fc1"}``); Flax's nested module paths
are joined by dots, as torch's FQNs are. Any other leaf keeps its name, under its
renamed module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucpformat.errors import InvalidValueError
from ucpformat.jax.tree import Rename, flat_leaves, fqn_of


def conv_perm(ndim: int) -> tuple[int, ...]:
    """Axes of a Flax kernel (spatial..., in, out) in torch's order (out, in, spatial...)."""
    return (ndim - 1, ndim - 2, *range(ndim - 2))


def rename_leaf(fqn: str, ndim: int, modules: Mapping[str, str]) -> Rename:
    """The torch name and axes of the Flax parameter ``fqn`` of ``ndim`` dimensions."""
    module, _, leaf = fqn.rpartition(".")
    torch_module = modules.get(module, module)
    if leaf == "kernel":
        if ndim < 2:
            raise InvalidValueError(f"a kernel of {ndim} dimensions has no torch weight",
                                    path=fqn)
        perm = (1, 0) if ndim == 2 else conv_perm(ndim)
        return Rename(f"{torch_module}.weight" if torch_module else "weight", perm)
    if leaf in ("embedding", "scale"):
        leaf = "weight"
    return Rename(f"{torch_module}.{leaf}" if torch_module else leaf)


def torch_keymap(params: Any, modules: Mapping[str, str] | None = None) -> dict[str, Rename]:
    """The key map of a Flax ``params`` tree (arrays or ShapeDtypeStructs) to torch's
    names and axes (see the module docstring); two leaves given one name are refused."""
    out: dict[str, Rename] = {}
    taken: dict[str, str] = {}
    for parts, value in flat_leaves(params):
        fqn = fqn_of(parts, "params/" + "/".join(parts))
        rule = rename_leaf(fqn, len(getattr(value, "shape", ())), modules or {})
        if rule.name in taken:
            raise InvalidValueError(f"{taken[rule.name]} and {fqn} both map to torch name "
                                    f"{rule.name!r}", path=fqn)
        taken[rule.name] = fqn
        out[fqn] = rule
    return out


__all__ = ["conv_perm", "rename_leaf", "torch_keymap"]
