"""Key-value storage under a checkpoint: the only code that touches files.

One backend per module: :mod:`~ucpformat.store.base` (the :class:`Store` interface, key
rules, the claim), :mod:`~ucpformat.store.local` (a local directory, links never
followed), :mod:`~ucpformat.store.fsspec_store` (object stores through fsspec),
:mod:`~ucpformat.store.forwarding` (the base of wrappers), :mod:`~ucpformat.store.guard`
(reads whose OS failures name the file), :mod:`~ucpformat.store.read_once` (what
validation reads, each stored object once) and :mod:`~ucpformat.store.archive` (a
checkpoint in one file, whose ZIP records are :mod:`~ucpformat.store.zip_layout`'s).
"""

from __future__ import annotations

import os
from typing import Any

from ucpformat.store.archive import (
    ArchiveStore,
    ArchiveWriter,
    check_directory_location,
    has_archive_suffix,
    is_archive_path,
    writes_archive,
)
from ucpformat.store.base import Store, StoreClaim, check_key, close_quietly, is_safe_key
from ucpformat.store.forwarding import ForwardingStore
from ucpformat.store.guard import ReadGuard, read_guarded, unguarded
from ucpformat.store.local import LocalStore
from ucpformat.store.posix import start_writeback
from ucpformat.store.read_once import ReadOnceStore


def open_store(
    location: str | os.PathLike[str] | Store,
    *,
    durable: bool = True,
    storage_options: Any = None,
) -> Store:
    """A Store for a path or URL (or an existing Store, returned as is).

    A URL such as ``s3://bucket/prefix`` (any protocol fsspec knows, with its package
    installed: s3fs for S3) gives an :class:`~ucpformat.store.fsspec_store.FsspecStore`;
    ``storage_options`` go to fsspec (credentials, ``client_kwargs``, ...). A local path
    that :func:`is_archive_path` calls a checkpoint in one file (a name ending in
    ``.ucpz``, or a regular file) gives an :class:`ArchiveStore`, which reads only.
    """
    if isinstance(location, Store):
        return location
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        from ucpformat.store.fsspec_store import FsspecStore

        return FsspecStore(text, storage_options=storage_options)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if is_archive_path(text):
        return ArchiveStore(text)
    return LocalStore(text, durable=durable)


__all__ = [
    "ArchiveStore",
    "ArchiveWriter",
    "ForwardingStore",
    "LocalStore",
    "ReadGuard",
    "ReadOnceStore",
    "Store",
    "StoreClaim",
    "check_directory_location",
    "check_key",
    "close_quietly",
    "has_archive_suffix",
    "is_archive_path",
    "is_safe_key",
    "open_store",
    "read_guarded",
    "start_writeback",
    "unguarded",
    "writes_archive",
]
