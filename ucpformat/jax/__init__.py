"""JAX training state (Flax, Optax) saved straight into UCP, and loaded on any mesh.

::

    import ucpformat.jax as ucpj

    ucpj.save("ckpt", {"params": params, "opt_state": opt_state}, step=step)  # every process
    state = ucpj.load("ckpt", jax.eval_shape(init))   # any mesh: shardings of the target

Every process writes only the boxes its devices hold, through the one distributed save
(:class:`ucpformat.distributed.pipeline.DistributedSave`); parameters and Adam moments
are stored under the names the torch integrations use (:mod:`ucpformat.jax.tree`), so
the same checkpoint loads in PyTorch. JAX is imported only here and below: ``import
ucpformat`` does not need it. See docs/jax.md."""

from __future__ import annotations

from ucpformat.optional import require

require("jax", extra="jax", purpose="ucpformat.jax")

from ucpformat.jax.comm import CoordinationCommunicator, communicator  # noqa: E402
from ucpformat.jax.load import host_state, load  # noqa: E402
from ucpformat.jax.mapping import torch_keymap  # noqa: E402
from ucpformat.jax.save import save, save_async  # noqa: E402
from ucpformat.jax.tree import Rename  # noqa: E402

__all__ = [
           "CoordinationCommunicator",
           "Rename",
           "communicator",
           "host_state",
           "load",
           "save",
           "save_async",
           "torch_keymap",
]
