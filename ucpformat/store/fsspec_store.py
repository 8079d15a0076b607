"""Checkpoints on object stores (S3, GCS, Azure, ...) and any other fsspec file system.

``open_store("s3://bucket/prefix", storage_options={...})`` returns an
:class:`FsspecStore`; every function that takes a path also takes the store. An object
store has no rename, and needs none (spec section 11.3): every object is written whole
by one PUT (or one completed multipart upload, which becomes visible at once), so the
commit is the single PUT of the root ``zarr.json`` (UCP-1.0-R054), ``flush`` has nothing
to do, and partial reads are HTTP range requests (``bytes=a-b``; the shard index is a
suffix request, ``bytes=-n``).

Keys are checked as for local files (UCP-1.0-R091): no key can name an object outside
the checkpoint's prefix. Directory listings are never cached, so a reader never takes an
old listing for the present, and they give every object's key as it is (a stray key with
``..`` is listed as such, never normalised into another object's key).

Object stores have no locks: a writer's claim on a location is its in-progress marker,
created with a conditional PUT where the store has one (S3's ``If-None-Match: *``, which
refuses the second of two writers), and every stored object is created the same way, so
that an object another writer put there first makes this writer's PUT fail instead of
replacing it (spec section 11.4 says what this guarantees).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ucpformat.errors import MissingDependencyError, UnsafePathError
from ucpformat.optional import require
from ucpformat.store import Store, check_key


class FsspecStore(Store):
    """A checkpoint under a prefix of an fsspec file system (``s3://bucket/prefix``)."""

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        fs: Any = None,
    ) -> None:
        options = dict(storage_options or {})
        if fs is None:
            purpose = f"the location {url.partition('://')[0]}://..."
            core = require("fsspec.core", extra="s3", purpose=purpose)
            # fresh instance, no listings cache: every exists/size asks the store
            options.setdefault("skip_instance_cache", True)
            options.setdefault("use_listings_cache", False)
            try:
                fs, path = core.url_to_fs(url, **options)
            except ImportError as exc:  # fsspec is there, its backend (s3fs, gcsfs...) not
                raise MissingDependencyError(
                    f"{purpose} needs a package fsspec uses for it, which is not installed "
                    f"(for s3://: pip install 'ucpformat[s3]'): {exc}", path=url,
                ) from exc
        else:
            path = fs._strip_protocol(url)
        root = str(path).rstrip("/")
        if not root or root in (".", "..") or "/../" in f"/{root}/":
            raise UnsafePathError(f"{url!r} names no checkpoint location", rule="UCP-1.0-R091")
        self.fs = fs
        self.root = root
        self.location = url.rstrip("/")

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.root}/{key}"

    # -- reads ----------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(self._full(key)))
        except FileNotFoundError:
            return None

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        full = self._full(key)
        if length <= 0:
            return b"" if self.size(key) is not None else None
        try:
            return bytes(self.fs.cat_file(full, start=offset, end=offset + length))
        except FileNotFoundError:
            return None
        except OSError as exc:
            # a range that starts at or past the end (HTTP 416): nothing there
            if "InvalidRange" in str(exc) or "416" in str(exc):
                return b""
            raise

    def get_suffix(self, key: str, length: int) -> bytes | None:
        if length <= 0:
            return b"" if self.size(key) is not None else None
        try:
            return bytes(self.fs.cat_file(self._full(key), start=-length))
        except FileNotFoundError:
            return None
        except OSError as exc:
            if "InvalidRange" in str(exc) or "416" in str(exc):
                return self.get(key)  # an object shorter than the suffix: all of it
            raise

    def size(self, key: str) -> int | None:
        try:
            info = self.fs.info(self._full(key))
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return int(info["size"])

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self.root if not prefix else self._full(prefix.rstrip("/"))
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return
        strip = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        for path in sorted(found):
            path = self.fs._strip_protocol(path)
            if path.startswith(strip) and path != strip:
                yield path[len(strip) :]  # as it is: a key with ".." is refused, not resolved

    # -- writes ---------------------------------------------------------------------------

    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        # One PUT whatever ``atomic`` says: an object appears whole or not at all.
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        self.fs.pipe_file(self._full(key), data)
        return len(data)

    @property
    def atomic_create(self) -> bool:  # type: ignore[override]
        """S3 refuses a conditional PUT (``If-None-Match: *``) onto an existing object."""
        return _conditional_put(self.fs)

    def create(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        if not _conditional_put(self.fs):
            return super().create(key, buffers, atomic=atomic)  # check, then put
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        try:
            self.fs.pipe_file(self._full(key), data, mode="create")
        except FileExistsError:
            raise
        except OSError as exc:  # 409: a conditional PUT of the same key is in flight
            if "ConditionalRequestConflict" in str(exc) or "409" in str(exc):
                raise FileExistsError(errno.EEXIST, str(exc), key) from exc
            raise
        return len(data)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._full(key))

    def delete_all(self) -> None:
        keys = list(self.list())
        if keys:
            self.fs.rm([f"{self.root}/{k}" for k in keys])


def _conditional_put(fs: Any) -> bool:
    """True for file systems whose ``pipe_file(mode="create")`` is one conditional PUT."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("s3", "s3a")


__all__ = ["FsspecStore"]
