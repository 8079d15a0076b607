"""PyTorch integration of ucpformat (needs torch; the format core never imports it).

Single process::

    import ucpformat.torch as ucpt
    ucpt.save("ckpt", model=model, optimizer=opt, scheduler=sched, step=step)
    result = ucpt.load("ckpt", model=model, optimizer=opt, scheduler=sched)

With ``torch.distributed.checkpoint``, ``ucpformat.torch.dcp`` is a storage plugin::

    dcp.save(state_dict, storage_writer=ucpformat.torch.dcp.UCPWriter("ckpt"))
    dcp.load(state_dict, storage_reader=ucpformat.torch.dcp.UCPReader("ckpt"))

``convert`` maps tensors to numpy arrays and back bit for bit; ``state`` defines the
checkpoint layout of a training state. Distributed saving and loading belong in further
modules of this subpackage and reuse both.
"""

from ucpformat.torch.convert import data_type, from_numpy, to_numpy, torch_dtype
from ucpformat.torch.state import (
    LoadResult,
    load,
    load_state_dict,
    optimizer_fqns,
    parameter_names,
    read_optimizer_state,
    save,
)

__all__ = [
    "LoadResult",
    "data_type",
    "from_numpy",
    "load",
    "load_state_dict",
    "optimizer_fqns",
    "parameter_names",
    "read_optimizer_state",
    "save",
    "to_numpy",
    "torch_dtype",
]

_LAZY_SUBMODULES = ("dcp", "dcp_keys")


def __getattr__(name: str) -> object:
    # ``ucpformat.torch.dcp`` without importing torch.distributed.checkpoint up front
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
