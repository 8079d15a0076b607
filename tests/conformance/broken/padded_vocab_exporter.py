"""Broken: the vocabulary padding of the ranks' local tensors is stored as rows of the tensor.

The suite must report UCP-1.0-R113 (vocabulary padding is not stored).
"""

import sys

from _load import adapter

exporter = adapter("zarr_exporter")
exporter.OPTIONS["drop_vocab_padding"] = False
sys.exit(exporter.main(sys.argv[1:]))
