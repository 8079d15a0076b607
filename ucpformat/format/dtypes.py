"""The closed list of data types of format 1.0: one table, the single source in code.

The spec's data-type table (spec/ucp-1.0.md) and the schema enum
(schemas/1.0/defs.schema.json) must list exactly these names; a test proves it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Final

import ml_dtypes
import numpy as np

from ucpformat.errors import FormatError, UnsupportedDtypeError


@dataclass(frozen=True)
class DataType:
    """One entry of the closed data-type list."""

    name: str  # the zarr v3 ``data_type`` name
    numpy: np.dtype[Any]  # little-endian numpy dtype (ml_dtypes for the extension types)
    kind: str  # "bool", "int", "uint", "float", "complex"
    torch_name: str | None  # attribute of the ``torch`` module, if torch has this type
    has_inf: bool = False
    has_nan: bool = False

    @property
    def itemsize(self) -> int:
        return int(self.numpy.itemsize)

    @property
    def is_extension(self) -> bool:
        """True for types that numpy has no native dtype for (bfloat16, float8)."""
        return self.name in EXTENSION_NAMES


def _dt(name: str, np_dtype: Any, kind: str, torch_name: str | None, **kw: bool) -> DataType:
    return DataType(name, np.dtype(np_dtype).newbyteorder("<"), kind, torch_name, **kw)


_FLOAT = {"has_inf": True, "has_nan": True}

DATA_TYPES: Final[tuple[DataType, ...]] = (
    _dt("bool", np.bool_, "bool", "bool"),
    _dt("int8", np.int8, "int", "int8"),
    _dt("int16", np.int16, "int", "int16"),
    _dt("int32", np.int32, "int", "int32"),
    _dt("int64", np.int64, "int", "int64"),
    _dt("uint8", np.uint8, "uint", "uint8"),
    _dt("uint16", np.uint16, "uint", "uint16"),
    _dt("uint32", np.uint32, "uint", "uint32"),
    _dt("uint64", np.uint64, "uint", "uint64"),
    _dt("float16", np.float16, "float", "float16", **_FLOAT),
    _dt("float32", np.float32, "float", "float32", **_FLOAT),
    _dt("float64", np.float64, "float", "float64", **_FLOAT),
    _dt("complex64", np.complex64, "complex", "complex64", **_FLOAT),
    _dt("complex128", np.complex128, "complex", "complex128", **_FLOAT),
    _dt("bfloat16", ml_dtypes.bfloat16, "float", "bfloat16", **_FLOAT),
    _dt("float8_e4m3fn", ml_dtypes.float8_e4m3fn, "float", "float8_e4m3fn", has_nan=True),
    _dt("float8_e5m2", ml_dtypes.float8_e5m2, "float", "float8_e5m2", **_FLOAT),
    _dt("float8_e4m3fnuz", ml_dtypes.float8_e4m3fnuz, "float", "float8_e4m3fnuz", has_nan=True),
    _dt("float8_e5m2fnuz", ml_dtypes.float8_e5m2fnuz, "float", "float8_e5m2fnuz", has_nan=True),
    _dt("float8_e8m0fnu", ml_dtypes.float8_e8m0fnu, "float", "float8_e8m0fnu", has_nan=True),
)

EXTENSION_NAMES: Final[frozenset[str]] = frozenset(
    {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
     "float8_e8m0fnu"}
)

BY_NAME: Final[dict[str, DataType]] = {d.name: d for d in DATA_TYPES}
NAMES: Final[tuple[str, ...]] = tuple(d.name for d in DATA_TYPES)

_BY_NUMPY: Final[dict[np.dtype[Any], DataType]] = {d.numpy: d for d in DATA_TYPES}


def by_name(name: str, *, tensor: str | None = None) -> DataType:
    """Look up a data type by its zarr v3 name; refuse names outside the closed list."""
    try:
        return BY_NAME[name]
    except (KeyError, TypeError):
        raise UnsupportedDtypeError(
            f"data type {name!r} is not in the closed list of format 1.0 "
            f"({', '.join(NAMES)})",
            rule="UCP-1.0-R020",
            tensor=tensor,
        ) from None


def from_numpy(dtype: np.dtype[Any], *, tensor: str | None = None) -> DataType:
    """Map a numpy dtype (either byte order) to its entry in the closed list."""
    found = _BY_NUMPY.get(dtype)  # (native or little-endian: the common case, one lookup)
    if found is None and dtype.byteorder not in ("|", "="):
        found = _BY_NUMPY.get(dtype.newbyteorder("<"))
    if found is None:
        raise UnsupportedDtypeError(
            f"numpy data type {dtype} has no entry in the closed list of format 1.0 "
            f"({', '.join(NAMES)})",
            rule="UCP-1.0-R020",
            tensor=tensor,
        )
    return found


# -- fill values ------------------------------------------------------------------------
#
# zarr v3 fill values: booleans for bool; integers for ints; for floating types a JSON
# number (UCP-1.0-R036), "NaN" (UCP-1.0-R037), "Infinity", "-Infinity", or a hex string "0x..."
# that gives the raw bits (exactly 2 * itemsize hex digits of either case, UCP-1.0-R038). Complex
# values are a two-element list of those.

#: The bits "NaN" stands for, per type (UCP-1.0-R037): zarr v3's quiet NaN (sign 0, the top
#: mantissa bit 1, the rest 0), or the type's only positive NaN where it has no such one.
NAN_BITS: Final[dict[str, int]] = {
    "float16": 0x7E00, "float32": 0x7FC00000, "float64": 0x7FF8000000000000,
    "bfloat16": 0x7FC0, "float8_e5m2": 0x7E, "float8_e4m3fn": 0x7F,
    "float8_e4m3fnuz": 0x80, "float8_e5m2fnuz": 0x80, "float8_e8m0fnu": 0xFF,
}
_HEX_DIGITS = re.compile(r"[0-9a-fA-F]+")


def fill_value_to_json(dt: DataType, value: Any) -> Any:
    """Encode a scalar as the zarr v3 JSON fill value for ``dt``."""
    if dt.kind == "bool":
        return bool(value)
    if dt.kind in ("int", "uint"):
        return int(value)
    if dt.kind == "complex":
        c = complex(value)
        half = BY_NAME["float32" if dt.name == "complex64" else "float64"]
        return [fill_value_to_json(half, c.real), fill_value_to_json(half, c.imag)]
    scalar = np.array(value, dtype=dt.numpy)
    as_float = float(scalar.astype(np.float64))
    if math.isnan(as_float):
        # Keep the exact NaN payload: hex of the raw bits.
        return _hex_bits(scalar)
    if math.isinf(as_float):
        return "Infinity" if as_float > 0 else "-Infinity"
    if dt.is_extension or dt.name == "float16":
        # Exact and unambiguous for narrow types: the raw bits.
        return _hex_bits(scalar)
    return as_float


def _hex_bits(scalar: np.ndarray[Any, Any]) -> str:
    raw = scalar.astype(scalar.dtype.newbyteorder("<")).tobytes()
    return "0x" + raw[::-1].hex()  # most significant byte first


#: Fill values parsed so far, by (data type, JSON type, value; a float by its repr, which
#: tells -0.0 from 0.0): the arrays of a checkpoint share a few, and an open parses each
#: array's. Numpy scalars are immutable, so one serves every array.
_FILL_VALUES: dict[tuple[str, type, Any], Any] = {}
_MAX_FILL_VALUES = 4096


def fill_value_from_json(dt: DataType, data: Any, *, tensor: str | None = None) -> Any:
    """Parse a zarr v3 JSON fill value for ``dt`` into a numpy scalar of that type.

    Hex strings are the raw bits *of this type* (``"0x3f80"`` is bfloat16 1.0, not
    float16 1.875).
    """
    kind = type(data)
    if (kind is not str and kind is not int and kind is not float) or BY_NAME.get(
            dt.name) is not dt:
        return _fill_value_from_json(dt, data, tensor)
    key = (dt.name, kind, repr(data) if kind is float else data)
    value = _FILL_VALUES.get(key)
    if value is None:
        value = _fill_value_from_json(dt, data, tensor)
        if len(_FILL_VALUES) < _MAX_FILL_VALUES:
            _FILL_VALUES[key] = value
    return value


def _fill_value_from_json(dt: DataType, data: Any, tensor: str | None) -> Any:
    """:func:`fill_value_from_json`, parsed."""

    def bad(why: str, rule: str = "UCP-1.0-R026") -> FormatError:
        return FormatError(
            f"fill_value {data!r} is not valid for data type {dt.name}: {why}",
            rule=rule,
            tensor=tensor,
        )

    if dt.kind == "bool":
        if not isinstance(data, bool):
            raise bad("expected true or false")
        return np.bool_(data)
    if dt.kind in ("int", "uint"):
        if isinstance(data, bool) or not isinstance(data, int):
            raise bad("expected an integer")
        info = np.iinfo(dt.numpy)
        if not info.min <= data <= info.max:
            raise bad("out of range")
        return dt.numpy.type(data)
    if dt.kind == "complex":
        if not (isinstance(data, list) and len(data) == 2):
            raise bad("expected [real, imag]")
        half = BY_NAME["float32" if dt.name == "complex64" else "float64"]
        re = fill_value_from_json(half, data[0], tensor=tensor)
        im = fill_value_from_json(half, data[1], tensor=tensor)
        return dt.numpy.type(complex(float(re), float(im)))
    # floating point
    if isinstance(data, str):
        if data[:2] in ("0x", "0X"):
            digits = data[2:]
            if (data[1] != "x" or len(digits) != 2 * dt.itemsize
                    or not _HEX_DIGITS.fullmatch(digits)):
                raise bad(f"a hex fill value is 0x and exactly {2 * dt.itemsize} hex digits",
                          "UCP-1.0-R038")
            return _from_bits(dt, int(digits, 16))
        if data == "NaN":
            return _from_bits(dt, NAN_BITS[dt.name])
        if data not in ("Infinity", "-Infinity"):
            raise bad('expected a number, "NaN", "Infinity", "-Infinity" or "0x..."')
        if not dt.has_inf:
            raise bad(f"{dt.name} has no infinities")
        return dt.numpy.type(math.inf if data == "Infinity" else -math.inf)
    if isinstance(data, bool) or not isinstance(data, int | float):
        raise bad("expected a number")
    try:
        as_float = float(data)  # the nearest binary64 first (UCP-1.0-R036)
    except OverflowError:
        raise bad("beyond the finite range of the type", "UCP-1.0-R036") from None
    if dt.name == "float8_e8m0fnu":
        mantissa, exponent = math.frexp(as_float)
        if mantissa != 0.5 or not -127 <= exponent - 1 <= 127:
            raise bad("float8_e8m0fnu holds powers of two from 2**-127 to 2**127 only; other "
                      "numbers are not rounded", "UCP-1.0-R036")
        return _from_bits(dt, exponent - 1 + 127)
    with np.errstate(over="ignore"):
        value = dt.numpy.type(as_float)  # then to the type, ties to even (UCP-1.0-R036)
    if not math.isfinite(float(value)):  # an overflow: never saturated, infinite or NaN
        raise bad("beyond the finite range of the type once rounded", "UCP-1.0-R036")
    return value



def _from_bits(dt: DataType, bits: int) -> Any:
    """The scalar of ``dt`` whose bits are ``bits``."""
    return np.frombuffer(bits.to_bytes(dt.itemsize, "little"), dtype=dt.numpy)[0]
