"""PyTorch DCP with the UCP plugin in place of its file-system storage.

::

    with filesystem_storage_swapped():
        dcp.save(state_dict, checkpoint_id=path)     # DCP's auto-detection picks UCPWriter
        torch_save_to_dcp("model.pt", path)          # format_utils' FileSystemWriter too

Inside the block, every place DCP names ``FileSystemWriter`` / ``FileSystemReader``
(``torch.distributed.checkpoint``, its storage auto-detection, ``format_utils``) gives
:class:`DropInWriter` / :class:`DropInReader`: the plugin with FileSystemWriter's and
FileSystemReader's constructors and defaults. Code and tests written for DCP's own storage
then run against UCP unchanged, which is how docs/dcp.md's list of differences is
checked (tests/torch/test_dcp_dropin.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

from ucpformat.torch.dcp import UCPWriter
from ucpformat.torch.dcp_reader import UCPReader


class DropInWriter(UCPWriter):
    """UCPWriter with FileSystemWriter's signature; ``overwrite`` defaults to True as
    there, ``sync_files`` is ``durable``, and the arguments about DCP's own file layout
    (files per rank, threads, copy-ahead, caching, extensions, format) have no meaning
    for UCP and are accepted and ignored."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Any = None,
        serialization_format: Any = None,
    ) -> None:
        super().__init__(path, overwrite=overwrite, durable=sync_files)


class DropInReader(UCPReader):
    """UCPReader with FileSystemReader's signature."""

    def __init__(self, path: str | os.PathLike[str], _extension_registry: Any = None) -> None:
        super().__init__(path)


@contextlib.contextmanager
def filesystem_storage_swapped() -> Iterator[None]:
    """Within the block, DCP's FileSystemWriter/Reader are :class:`DropInWriter`/Reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _storage_utils, format_utils

    with contextlib.ExitStack() as stack:
        for module in (dcp, _storage_utils, format_utils):
            stack.enter_context(mock.patch.object(module, "FileSystemWriter", DropInWriter))
            stack.enter_context(mock.patch.object(module, "FileSystemReader", DropInReader))
        yield


__all__ = ["DropInReader", "DropInWriter", "filesystem_storage_swapped"]
