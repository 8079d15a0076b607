"""PyTorch integration of ucpformat (needs torch; the format core never imports it).

Single process::

    import ucpformat.torch as ucpt
    ucpt.save("ckpt", model=model, optimizer=opt, scheduler=sched, step=step)
    result = ucpt.load("ckpt", model=model, optimizer=opt, scheduler=sched)

A flat mapping of tensors, safetensors-style (:mod:`ucpformat.torch.flat`)::

    ucpt.save_file({"w": w}, "ckpt"); ucpt.load_file("ckpt")
    with ucpt.safe_open("ckpt", framework="pt") as f: f.get_slice("w")[:, :8]

``convert`` maps tensors to numpy arrays and back bit for bit; ``state`` defines the
checkpoint layout of a training state.

Distributed (every rank calls it; FSDP2, tensor parallel, HSDP, 2-D meshes; the same
checkpoint layout, so any saved layout loads into any other or into one process)::

    ucpt.save_distributed("ckpt", model=model, optimizer=opt, step=step)
    ucpt.load_distributed("ckpt", model=model, optimizer=opt)
    saver = ucpt.AsyncSaver(); saver.save("ckpt", model=model, optimizer=opt)  # background

Those names are imported on first use (``torch.distributed`` modules take a while to
import); see :mod:`ucpformat.torch.distributed` and :mod:`ucpformat.torch.async_save`.

With ``torch.distributed.checkpoint``, ``ucpformat.torch.dcp`` is a storage plugin::

    dcp.save(state_dict, storage_writer=ucpformat.torch.dcp.UCPWriter("ckpt"))
    dcp.load(state_dict, storage_reader=ucpformat.torch.dcp.UCPReader("ckpt"))
"""

from typing import TYPE_CHECKING, Any

from ucpformat.optional import require

require("torch", extra="torch", purpose="ucpformat.torch")  # a missing torch: name the extra

from ucpformat.torch.flat import SafeOpen, load_file, safe_open, save_file  # noqa: E402
from ucpformat.torch.numpy_bridge import data_type, from_numpy, to_numpy, torch_dtype  # noqa: E402
from ucpformat.torch.rng import rng_state, set_rng_state  # noqa: E402
from ucpformat.torch.state import (  # noqa: E402
    LoadResult,
    MetaTensorWarning,
    load,
    load_state_dict,
    optimizer_fqns,
    parameter_names,
    read_optimizer_state,
    save,
)

if TYPE_CHECKING:
    from ucpformat.torch.async_save import AsyncSaver, close_async, save_async, wait_async
    from ucpformat.torch.distributed import load_distributed, save_distributed
    from ucpformat.torch.staging import HostBufferPool, Staging

_LAZY = {
    "AsyncSaver": "ucpformat.torch.async_save",
    "close_async": "ucpformat.torch.async_save",
    "save_async": "ucpformat.torch.async_save",
    "wait_async": "ucpformat.torch.async_save",
    "load_distributed": "ucpformat.torch.distributed",
    "save_distributed": "ucpformat.torch.distributed",
    "HostBufferPool": "ucpformat.torch.staging",
    "Staging": "ucpformat.torch.staging",
}


#: Submodules reachable as attributes (``ucpformat.torch.dcp.UCPWriter``), imported on use.
_LAZY_SUBMODULES = ("dcp", "dcp_keys", "staging")


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _LAZY.get(name)
    if module is None:
        from ucpformat.compat import moved_attribute  # planner, convert: moved in 0.2

        return moved_attribute(__name__, name)
    return getattr(importlib.import_module(module), name)


__all__ = [
    "AsyncSaver",
    "HostBufferPool",
    "LoadResult",
    "MetaTensorWarning",
    "SafeOpen",
    "Staging",
    "close_async",
    "data_type",
    "from_numpy",
    "load",
    "load_distributed",
    "load_file",
    "load_state_dict",
    "optimizer_fqns",
    "parameter_names",
    "read_optimizer_state",
    "rng_state",
    "safe_open",
    "save",
    "save_async",
    "save_distributed",
    "save_file",
    "set_rng_state",
    "to_numpy",
    "torch_dtype",
    "wait_async",
]

