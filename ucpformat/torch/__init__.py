"""PyTorch integration of ucpformat (needs torch; the format core never imports it).

Single process::

    import ucpformat.torch as ucpt
    ucpt.save("ckpt", model=model, optimizer=opt, scheduler=sched, step=step)
    result = ucpt.load("ckpt", model=model, optimizer=opt, scheduler=sched)

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
