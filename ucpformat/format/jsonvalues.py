"""JSON values stored in a checkpoint (hyperparameters, scheduler state, step counters).

Values are RFC 8259 JSON. Non-finite floats, which JSON cannot hold, are written as the
tagged object ``{"$ucp_float": "NaN" | "Infinity" | "-Infinity"}`` (spec UCP-1.0-R070).
Tuples become lists; numpy scalars become Python numbers. The nesting limit of whole
metadata documents (UCP-1.0-R096) is here too, since rule files share it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from ucpformat.errors import FormatError, InvalidValueError

FLOAT_TAG = "$ucp_float"
_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
MAX_DEPTH = 64


def is_json_value(value: Any) -> bool:
    """True for values stored as JSON (everything that is not an array or a group)."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(is_json_value(v) for v in value)
    if isinstance(value, Mapping):
        return all(is_json_value(v) for v in value.values())
    return False


def encode(value: Any, *, where: str, depth: int = 0) -> Any:
    """Python value -> JSON-safe value, refusing what cannot round-trip."""
    if depth > MAX_DEPTH:
        raise InvalidValueError(f"value nested deeper than {MAX_DEPTH} levels",
                                rule="UCP-1.0-R070", path=where)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        _check_text(value, where)
        return value
    if isinstance(value, np.generic):
        value = value.item()
        if isinstance(value, complex):
            raise InvalidValueError("complex scalars are stored as arrays, not JSON values",
                                    rule="UCP-1.0-R070", path=where)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        tag = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        return {FLOAT_TAG: tag}
    if isinstance(value, list | tuple):
        return [encode(v, where=f"{where}[{i}]", depth=depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidValueError(
                    f"JSON object keys must be strings, got {type(k).__name__} {k!r}",
                    rule="UCP-1.0-R070",
                    path=where,
                )
            _check_text(k, where)
            out[k] = encode(v, where=f"{where}.{k}", depth=depth + 1)
        if FLOAT_TAG in out:
            raise InvalidValueError(
                f"the key {FLOAT_TAG!r} is reserved for non-finite floats",
                rule="UCP-1.0-R070",
                path=where,
            )
        return out
    raise InvalidValueError(
        f"{type(value).__name__} is neither an array nor a JSON value", rule="UCP-1.0-R070",
        path=where,
    )


def _check_text(text: str, where: str) -> None:
    """Refuse strings that have no UTF-8 encoding (lone surrogates): JSON files are UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidValueError(
            f"string {text[:60]!r} is not valid Unicode (lone surrogate)",
            rule="UCP-1.0-R070",
            path=where,
        ) from None


def decode(value: Any, *, where: str, depth: int = 0) -> Any:
    """JSON value from a checkpoint -> Python value."""
    if depth > MAX_DEPTH:
        raise FormatError(f"value nested deeper than {MAX_DEPTH} levels", rule="UCP-1.0-R070",
                          path=where)
    if isinstance(value, list):
        return [decode(v, where=where, depth=depth + 1) for v in value]
    if isinstance(value, Mapping):
        if FLOAT_TAG in value:
            tag = value.get(FLOAT_TAG)
            if len(value) != 1 or not isinstance(tag, str) or tag not in _SPECIAL:
                raise FormatError(
                    f"malformed non-finite float {dict(value)!r}", rule="UCP-1.0-R070", path=where
                )
            return _SPECIAL[str(tag)]
        return {k: decode(v, where=where, depth=depth + 1) for k, v in value.items()}
    return value


#: Deepest nesting of a metadata document (JSON values nest at most 64 levels, UCP-1.0-R070,
#: below at most 8 levels of document structure); deeper documents are refused before
#: anything walks them recursively (UCP-1.0-R096).
MAX_DOCUMENT_DEPTH: Final = 80


def json_depth(doc: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0), computed without recursion, one
    level of containers at a time."""
    depth = 0
    level = [doc] if isinstance(doc, (dict, list)) else []
    while level:
        depth += 1
        below: list[Any] = []
        for value in level:
            children = value.values() if isinstance(value, dict) else value
            below.extend([v for v in children if isinstance(v, (dict, list))])
        level = below
    return depth


def json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values as the spec defines it (UCP-1.0-R073).

    Values of different kinds differ (``1``, ``1.0`` and ``true`` are three values);
    integers compare exactly at any size; numbers with a fraction or an exponent (Python
    floats) compare by their binary64 bits, so ``-0.0`` differs from ``0.0``; objects
    compare member by member in any order, arrays element by element.
    """
    if type(a) is not type(b):
        return isinstance(a, Mapping) and isinstance(b, Mapping) and _objects_equal(a, b)
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, Mapping):
        return _objects_equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _objects_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
