"""The array engine: how a tensor's bytes are laid out in the files of a checkpoint.

Everything of the byte format of format 1.0's arrays (zarr v3) lives here, apart from
the checkpoint API (:mod:`ucpformat.checkpoint.reader`, :mod:`ucpformat.checkpoint.writer`) and the
metadata documents (:mod:`ucpformat.checkpoint.metadata`):

- :mod:`~ucpformat.engine.chunking`: how a tensor is cut into inner chunks and shards;
- :mod:`~ucpformat.engine.grid`: the grid of stored objects, their regions and keys;
- :mod:`~ucpformat.engine.checksum`: the ``crc32c`` codec;
- :mod:`~ucpformat.engine.compression`: the compressors (zstd, gzip, blosc);
- :mod:`~ucpformat.engine.codecs`: a chunk's codec chain, bytes -> compressor -> crc32c;
- :mod:`~ucpformat.engine.shard_index`: the shard format (index, packing);
- :mod:`~ucpformat.engine.write`: encoding and writing one stored object;
- :mod:`~ucpformat.engine.read`: reading boxes of an array, every chunk CRC-checked.
- :mod:`~ucpformat.engine.memory`: host memory for the new arrays a load reads into.

The engine imports no torch and nothing of the checkpoint API: besides its own modules,
only ``dtypes`` and ``errors`` (and ``storage``, where ``write`` and ``read`` reach the
files). :mod:`ucpformat.checkpoint.metadata` builds on the codec modules (an array's codec chain is
part of its metadata); ``grid``, ``write`` and ``read`` take that metadata
(:class:`~ucpformat.checkpoint.metadata.ArrayMeta`) but import it for type checking only.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    from ucpformat.compat import moved_attribute  # the modules that moved in 0.2

    return moved_attribute(__name__, name)
