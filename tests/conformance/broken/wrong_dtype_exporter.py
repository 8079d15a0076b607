"""Broken: PyTorch's float8_e4m3fn written under the name float8_e4m3 (a different type).

The reference writer with one entry of its data-type table renamed. The suite must
report UCP-1.0-R020.
"""

import dataclasses
import sys

import ml_dtypes
import numpy as np

from ucpformat.conformance.adapters import reference
from ucpformat.format import dtypes

entry = dtypes.BY_NAME["float8_e4m3fn"]
wrong = dataclasses.replace(entry, name="float8_e4m3")
dtypes._BY_NUMPY[np.dtype(ml_dtypes.float8_e4m3fn)] = wrong
dtypes.BY_NAME["float8_e4m3fn"] = wrong  # the scenario's name now gives the wrong entry
dtypes.BY_NAME["float8_e4m3"] = wrong
sys.exit(reference.main(sys.argv[1:]))
