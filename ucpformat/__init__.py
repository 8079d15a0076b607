"""ucpformat: universal training checkpoints on zarr v3.

The format core (this package minus ``ucpformat.torch``) needs numpy and zarr only::

    import ucpformat
    ucpformat.save("ckpt", {"model": {"fc.weight": w}, "training": {"step": 10}})
    ckpt = ucpformat.open("ckpt")
    ckpt["model/fc.weight"][:, :128]      # reads only the chunks it needs
    ucpformat.validate("ckpt", deep=True)  # a Report; every problem names its requirement
"""

# compat first: the old import paths of moved modules work for one release (it installs
# its finder on import, before anything else of ucpformat is imported)
from typing import Any

from ucpformat import compat, errors
from ucpformat._version import __version__
from ucpformat.checkpoint.adopt import adopt
from ucpformat.checkpoint.metadata import FORMAT_VERSION
from ucpformat.checkpoint.pack import PackResult, pack, unpack
from ucpformat.checkpoint.reader import Checkpoint, Tensor, open_checkpoint
from ucpformat.checkpoint.tree import Group
from ucpformat.checkpoint.validation import Issue, Report, validate
from ucpformat.checkpoint.writer import SaveResult, save
from ucpformat.errors import UCPError
from ucpformat.format.dtypes import DATA_TYPES, DataType
from ucpformat.format.zarr_dtypes import register as _register_zarr_dtypes

_register_zarr_dtypes()

open = open_checkpoint  # ``ucpformat.open(path)`` is the documented entry point


def __getattr__(name: str) -> Any:
    return compat.moved_attribute(__name__, name)  # ucpformat.storage and the other moves

__all__ = [
    "DATA_TYPES",
    "FORMAT_VERSION",
    "Checkpoint",
    "DataType",
    "Group",
    "Issue",
    "PackResult",
    "Report",
    "SaveResult",
    "Tensor",
    "UCPError",
    "__version__",
    "adopt",
    "errors",
    "open",
    "open_checkpoint",
    "pack",
    "save",
    "unpack",
    "validate",
]
