"""How a save writes: one options object that every writer takes and passes through.

``ucpformat.save``, the distributed save (:class:`ucpformat.distributed.pipeline.DistributedSave`,
``ucpformat.distributed.save_fragments``), and the torch, DCP, DeepSpeed, Megatron and
JAX integrations read their grid, codec, durability and concurrency settings from one
:class:`SaveOptions`. Their documented keyword arguments (``chunk_bytes=...``) are the
same fields, packed once by :meth:`SaveOptions.merged`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ucpformat.engine.chunking import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MIN_SHARD_BYTES,
    DEFAULT_SHARD_BYTES,
    DEFAULT_SPLITS,
)
from ucpformat.errors import InvalidValueError

#: Hash algorithms a manifest may record (UCP-1.0-R044).
HASH_ALGORITHMS = ("sha256",)


@dataclass(frozen=True)
class SaveOptions:
    """How a save writes (every field has the default a plain ``save`` uses).

    - ``compression``: ``None`` (raw), ``"zstd"``, ``"gzip"``, ``"blosc"`` or a codec
      object (``{"name": "zstd", "configuration": {"level": 3}}``);
    - ``chunk_bytes``: the target size of an inner chunk, the unit of reading (1 MiB);
    - ``shard_bytes``: the target size of a shard, the unit of writing (1 GiB);
    - ``chunk_splits``: single-process saves cut inner chunks smaller than
      ``chunk_bytes`` so that splitting a dimension into up to this many equal parts
      (tensor parallelism, FSDP) falls on chunk boundaries (8); 1 keeps every chunk as
      large as ``chunk_bytes`` allows (``save_file``: each tensor one chunk, which a
      reader can use in place). Distributed saves cut chunks on the fragments' grid and
      refuse another value;
    - ``min_shard_bytes``: distributed saves only: shards smaller than this are
      assembled by one rank from cells the others send (1 MiB; 0: no minimum);
    - ``hash_algorithm``: ``"sha256"`` to record each file's digest in the manifest (any
      other value is refused: before 0.2 the distributed saves ignored it);
    - ``overwrite``: replace a committed checkpoint at the location (it stays committed
      until the save has gathered everything it needs, UCP-1.0-R053);
    - ``workers``: writer threads per process (None or 0: twice the CPUs, 2 to 16);
    - ``durable``: fsync files and directories before the commit (off only for tests
      and scratch space);
    - ``progress``: a progress bar (``True``) or a callback taking bytes written.
    """

    compression: str | Mapping[str, Any] | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    shard_bytes: int = DEFAULT_SHARD_BYTES
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES
    hash_algorithm: str | None = None
    overwrite: bool = False
    workers: int | None = None
    durable: bool = True
    progress: bool | Callable[[int], None] = False
    chunk_splits: int = DEFAULT_SPLITS  # last: the fields before it may be given by position

    def __post_init__(self) -> None:
        if self.hash_algorithm not in (None, *HASH_ALGORITHMS):
            raise InvalidValueError(
                f"hash_algorithm must be one of {HASH_ALGORITHMS} or None, not "
                f"{self.hash_algorithm!r}", rule="UCP-1.0-R044")
        for name in ("chunk_bytes", "shard_bytes"):
            if int(getattr(self, name)) <= 0:
                raise InvalidValueError(f"{name} must be positive, not {getattr(self, name)}")
        if int(self.chunk_splits) < 1:
            raise InvalidValueError(f"chunk_splits must be at least 1, not {self.chunk_splits}")
        if self.min_shard_bytes < 0:
            raise InvalidValueError(f"min_shard_bytes must be >= 0, not {self.min_shard_bytes}")
        if self.workers is not None and self.workers < 0:
            raise InvalidValueError(f"workers must be at least 1 (or 0 / None: the default), "
                                    f"not {self.workers}")
        if self.workers == 0:  # as every save took it before 0.2: the default
            object.__setattr__(self, "workers", None)

    @classmethod
    def merged(cls, options: SaveOptions | None, *,
               defaults: Mapping[str, Any] | None = None, **keywords: Any) -> SaveOptions:
        """The options of a call that takes both ``options=`` and the same settings as
        keyword arguments: ``options`` if given (then every keyword must be left at its
        default, or the call is refused: a setting given twice is ambiguous), else the
        keywords packed. ``defaults``: the call's own defaults where they differ from
        this class's (``StreamingWriter`` hashes by default)."""
        unknown = sorted(set(keywords) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"SaveOptions has no field {unknown[0]!r}")
        if options is None:
            return cls(**keywords)
        base = {**dataclasses.asdict(cls()), **dict(defaults or {})}
        given = sorted(k for k, v in keywords.items() if v != base[k])
        if given:
            raise InvalidValueError(
                f"pass the save's settings either as options=SaveOptions(...) or as keyword "
                f"arguments, not both ({', '.join(given)} given beside options)")
        return options

    def replace(self, **changes: Any) -> SaveOptions:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)
