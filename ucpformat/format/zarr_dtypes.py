"""zarr-python data-type plugins for bfloat16 and the float8 types.

zarr-python 3.1 has no bfloat16 or float8 data types. These classes teach it the
ones in ucpformat's closed list, with numpy scalars from ``ml_dtypes``, so that plain
``zarr.open`` reads and writes UCP checkpoints. They are registered when
``ucpformat`` is imported, and, for users who only import zarr, by the start-up hook
the wheel installs (``hooks/_ucpformat_zarr.py``: zarr-python 3.1 and 3.2 never load
the ``zarr.data_type`` entry point ucpformat declares; docs/zarr-python.md). A name
that zarr-python already knows is left to zarr-python.

Two traps are handled here:

* hex fill values are the raw bits *of this type* (zarr-python's own float parsing would
  read ``"0x3f80"`` as float16 1.875 instead of bfloat16 1.0);
* 1-byte types have no endianness, so the ``bytes`` codec omits ``endian`` (tensorstore
  refuses it otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import DataTypeValidationError, HasEndianness, HasItemSize
from zarr.core.dtype.wrapper import ZDType

from ucpformat.format import dtypes as _dt

_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class _ExtensionFloat(ZDType[Any, Any], HasItemSize):
    """Shared behaviour of the ml_dtypes-backed floating point types."""

    _zarr_v3_name: ClassVar[str]
    _entry: ClassVar[_dt.DataType]

    # -- native dtype ---------------------------------------------------------------

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> Any:
        try:
            native = np.dtype(dtype)
        except TypeError:
            raise DataTypeValidationError(f"{dtype!r} is not a numpy dtype") from None
        if native.newbyteorder("<") == cls._entry.numpy or native == cls._entry.numpy:
            return cls._from_native(native)
        raise DataTypeValidationError(f"{dtype} is not {cls._zarr_v3_name}")

    @classmethod
    def _from_native(cls, native: np.dtype[Any]) -> Any:
        return cls()

    def to_native_dtype(self) -> Any:
        return self._entry.numpy

    @property
    def item_size(self) -> int:
        return self._entry.itemsize

    # -- JSON -----------------------------------------------------------------------

    @classmethod
    def _from_json_v2(cls, data: Any) -> Any:
        raise DataTypeValidationError(f"{cls._zarr_v3_name} is a zarr v3 data type only")

    @classmethod
    def _from_json_v3(cls, data: Any) -> Any:
        if data == cls._zarr_v3_name:
            return cls()
        raise DataTypeValidationError(f"expected {cls._zarr_v3_name!r}, got {data!r}")

    def to_json(self, zarr_format: Any) -> Any:
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"{self._zarr_v3_name} exists only in zarr format 3")

    # -- scalars --------------------------------------------------------------------

    def _check_scalar(self, data: object) -> bool:
        if isinstance(data, str):
            return data in _SPECIAL or data.startswith("0x")
        return isinstance(data, int | float | np.generic) and not isinstance(data, bool)

    def cast_scalar(self, data: object) -> Any:
        if not self._check_scalar(data):
            raise TypeError(f"cannot cast {data!r} to {self._zarr_v3_name}")
        if isinstance(data, str):
            return _dt.fill_value_from_json(self._entry, data)
        return self._entry.numpy.type(data)

    def default_scalar(self) -> Any:
        return self._entry.numpy.type(0)

    def from_json_scalar(self, data: Any, *, zarr_format: Any) -> Any:
        try:
            return _dt.fill_value_from_json(self._entry, data)
        except Exception as exc:  # zarr expects TypeError for malformed scalars
            raise TypeError(str(exc)) from exc

    def to_json_scalar(self, data: object, *, zarr_format: Any) -> Any:
        return _dt.fill_value_to_json(self._entry, self.cast_scalar(data))


@dataclass(frozen=True, kw_only=True)
class _MultiByteFloat(_ExtensionFloat, HasEndianness):
    """A multi-byte extension float: the ``bytes`` codec records its byte order."""

    endianness: Literal["little", "big"] = field(default="little")

    @classmethod
    def _from_native(cls, native: np.dtype[Any]) -> Any:
        return cls(endianness="big" if native.byteorder == ">" else "little")

    def to_native_dtype(self) -> Any:
        base = self._entry.numpy
        return base.newbyteorder(">") if self.endianness == "big" else base


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MultiByteFloat):
    """bfloat16: 1 sign, 8 exponent, 7 mantissa bits (the top half of an IEEE float32)."""

    _zarr_v3_name: ClassVar[str] = "bfloat16"
    _entry: ClassVar[_dt.DataType] = _dt.BY_NAME["bfloat16"]
    dtype_cls: ClassVar[Any] = type(_dt.BY_NAME["bfloat16"].numpy)


def _one_byte(name: str) -> type[_ExtensionFloat]:
    entry = _dt.BY_NAME[name]
    cls: type[_ExtensionFloat] = dataclass(frozen=True, kw_only=True)(
        type(
            "".join(p.upper() if p.startswith("e") else p.capitalize() for p in name.split("_")),
            (_ExtensionFloat,),
            {
                "__doc__": f"{name}: a 1-byte float (no endianness).",
                "_zarr_v3_name": name,
                "_entry": entry,
                "dtype_cls": type(entry.numpy),
                "__annotations__": {},
            },
        )
    )
    return cls


Float8E4M3FN = _one_byte("float8_e4m3fn")
Float8E5M2 = _one_byte("float8_e5m2")
Float8E4M3FNUZ = _one_byte("float8_e4m3fnuz")
Float8E5M2FNUZ = _one_byte("float8_e5m2fnuz")
Float8E8M0FNU = _one_byte("float8_e8m0fnu")

PLUGINS: tuple[type[_ExtensionFloat], ...] = (
    BFloat16,
    Float8E4M3FN,
    Float8E5M2,
    Float8E4M3FNUZ,
    Float8E5M2FNUZ,
    Float8E8M0FNU,
)


#: The module of the stand-ins that the import hook shipped with the wheel registers
#: before ucpformat is imported (hooks/_ucpformat_zarr.py); these classes replace them.
IMPORT_HOOK = "_ucpformat_zarr"


def register() -> None:
    """Register the plugins with zarr-python (idempotent; zarr's own types win).

    A name is (re)registered in place, never removed and added: zarr may be iterating
    over its registry when the import hook's stand-in calls this.
    """
    data_type_registry._lazy_load()
    for cls in PLUGINS:
        existing = data_type_registry.contents.get(cls._zarr_v3_name)
        if existing is None or existing.__module__ in (__name__, IMPORT_HOOK):
            data_type_registry.register(cls._zarr_v3_name, cls)  # type: ignore[arg-type]


def zdtype_for(name: str) -> ZDType[Any, Any]:
    """The zarr-python data-type object for a name of the closed list."""
    register()
    return data_type_registry.get(name).from_json(name, zarr_format=3)  # type: ignore[no-any-return]


__all__ = [
    "PLUGINS",
    "BFloat16",
    "Float8E4M3FN",
    "Float8E4M3FNUZ",
    "Float8E5M2",
    "Float8E5M2FNUZ",
    "Float8E8M0FNU",
    "register",
    "zdtype_for",
]
