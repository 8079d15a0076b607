#!/usr/bin/env python3
"""An independent UCP 1.0 reader adapter built on tensorstore, written from the spec's text.

It does not import ucpformat (a test checks that): tensorstore reads the zarr arrays;
this file adds what a generic zarr reader lacks and spec/ucp-1.0.md requires:

* the root ``zarr.json`` as strict JSON (UCP-1.0-R001), checked against the JSON Schemas of
  ``schemas/1.0`` (found next to this repository, or in ``$UCP_SCHEMAS``), then the rules
  the schemas cannot express: version (UCP-1.0-R060), ``must_understand`` (UCP-1.0-R061), canonical
  node
  names (UCP-1.0-R010, UCP-1.0-R012), parent groups (UCP-1.0-R005), endianness (UCP-1.0-R023), fill
  values (UCP-1.0-R026, UCP-1.0-R036 to
  UCP-1.0-R038: tensorstore is handed them as bits, since it rounds some numbers otherwise), sizes
  (UCP-1.0-R027), shard shapes (UCP-1.0-R028);
* before reading, every stored object the selection needs exists, and no shard index
  entry it needs is empty (UCP-1.0-R031) -- tensorstore would return fill values instead --
  unless the array is sparse (UCP-1.0-R032); no entry reaches into its shard's index
  (UCP-1.0-R048); every
  zstd chunk is one frame that declares its size and no larger window (UCP-1.0-R047), which
  tensorstore does not check; no file is a link out of the checkpoint (UCP-1.0-R091);
* layout-aware reading of target layouts (spec/ucp-1.0-layout.md, section 2).

Usage (the adapter contract of spec/ucp-1.0-conformance.md)::

    tensorstore_reader.py capabilities
    tensorstore_reader.py read CHECKPOINT REQUEST_JSON
    tensorstore_reader.py read-batch BATCH_JSON
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

R = "UCP-1.0-R"
SAFE = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
NODE_NAME = re.compile(r"^(?:[A-Za-z0-9._-]|%[0-9A-F]{2})+$")
VERSION = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")
EMPTY = 2**64 - 1

# Table 1: name -> (bytes, kind, largest finite value, has infinities)
TYPES: dict[str, tuple[int, str, float, bool]] = {
    "bool": (1, "bool", 0, False),
    "int8": (1, "int", 2**7 - 1, False), "int16": (2, "int", 2**15 - 1, False),
    "int32": (4, "int", 2**31 - 1, False), "int64": (8, "int", 2**63 - 1, False),
    "uint8": (1, "uint", 2**8 - 1, False), "uint16": (2, "uint", 2**16 - 1, False),
    "uint32": (4, "uint", 2**32 - 1, False), "uint64": (8, "uint", 2**64 - 1, False),
    "float16": (2, "float", 65504.0, True), "float32": (4, "float", 3.4028234663852886e38, True),
    "float64": (8, "float", sys.float_info.max, True),
    "complex64": (8, "complex", 3.4028234663852886e38, True),
    "complex128": (16, "complex", sys.float_info.max, True),
    "bfloat16": (2, "float", 3.3895313892515355e38, True),
    "float8_e4m3fn": (1, "float", 448.0, False), "float8_e5m2": (1, "float", 57344.0, True),
    "float8_e4m3fnuz": (1, "float", 240.0, False), "float8_e5m2fnuz": (1, "float", 57344.0, False),
    "float8_e8m0fnu": (1, "float", 2.0**127, False),
}


#: Data types to leave out, to try the suite's handling of readers that lack some
#: (comma-separated names in $UCP_TS_WITHOUT); they are refused by name (UCP-1.0-R092).
WITHOUT = {t for t in os.environ.get("UCP_TS_WITHOUT", "").split(",") if t}


class Refused(Exception):
    """The checkpoint (or a tensor, or a target) breaks a requirement: refuse it."""

    def __init__(self, rule: str | None, message: str) -> None:
        super().__init__(message)
        self.rule = rule
        self.message = message

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"message": self.message}
        if self.rule:
            doc["rule"] = self.rule
        return doc


# -- names (spec section 6) ----------------------------------------------------------------------


def escape(name: str) -> str:
    raw = name.encode("utf-8")
    if name and set(name) == {"."}:
        return "%2E" * len(name)
    out = []
    for i, byte in enumerate(raw):
        keep = byte in SAFE and not (i == 0 and byte == ord("_") and raw.startswith(b"__"))
        out.append(chr(byte) if keep else f"%{byte:02X}")
    text = "".join(out)
    if text.lower() == "zarr.json":
        text = text[:4] + "%2E" + text[5:]
    return text


def check_node_name(node: str) -> None:
    if not NODE_NAME.match(node):
        raise Refused(R + "010", f"node name {node!r} is not an escaped name")
    if len(node) > 255:
        raise Refused(R + "012", f"node name {node[:40]!r}... is longer than 255 bytes")
    raw = bytearray()
    i = 0
    while i < len(node):
        if node[i] == "%":
            raw.append(int(node[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.append(ord(node[i]))
            i += 1
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused(R + "010", f"node name {node!r} is not UTF-8") from None
    if not name or "\x00" in name or escape(name) != node:
        raise Refused(R + "010", f"node name {node!r} is not the canonical escape of a name")


# -- strict JSON and the schemas --------------------------------------------------------------


def strict_json(data: bytes, what: str) -> Any:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ValueError(f"duplicate member {key!r}")
            out[key] = value
        return out

    def constant(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    if data.startswith(b"\xef\xbb\xbf"):  # Python's json.loads(bytes) would skip it
        raise Refused(R + "009", f"{what} begins with a byte order mark")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refused(R + "001", f"{what} is not valid JSON: {exc}") from None
    try:  # UCP-1.0-R006: every string Unicode text; a lone \ud800 escape has no UTF-8 encoding
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise Refused(R + "006", f"{what} holds an unpaired surrogate escape") from None
    return doc


def check_root_digest(data: bytes, root: Any) -> None:
    """UCP-1.0-R058: the root's SHA-256, with its own 64 digits written as 0, is root_sha256."""
    ucp = (root.get("attributes") or {}).get("ucp") if isinstance(root, dict) else None
    digest = ucp.get("root_sha256") if isinstance(ucp, dict) else None
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return  # the schema check names it
    token = f'"{digest}"'.encode()
    pos = data.find(token) + 1
    if pos == 0 or data.find(token, pos) >= 0:
        raise Refused(R + "058", "root_sha256 must appear exactly once in the root")
    zeroed = data[:pos] + b"0" * 64 + data[pos + 64 :]
    if hashlib.sha256(zeroed).hexdigest() != digest:
        raise Refused(R + "058", "the root zarr.json is damaged: its SHA-256 differs from "
                      "root_sha256")


def schema_dir() -> Path:
    env = os.environ.get("UCP_SCHEMAS")
    if env:
        return Path(env)
    base = Path(__file__).resolve().parents[2]  # the repository, or an installed ucpformat
    for candidate in (base / "schemas" / "1.0", base / "_schemas" / "1.0"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("the UCP 1.0 JSON Schemas are not found: set UCP_SCHEMAS")


_VALIDATOR: Any = None


def root_validator() -> Any:
    global _VALIDATOR
    if _VALIDATOR is None:
        import jsonschema
        from referencing import Registry, Resource
        from referencing.jsonschema import DRAFT202012

        resources = []
        for path in sorted(schema_dir().glob("*.schema.json")):
            doc = json.loads(path.read_text(encoding="utf-8"))
            resources.append((doc["$id"], Resource.from_contents(
                doc, default_specification=DRAFT202012)))
        registry = Registry().with_resources(resources)
        root = registry.contents("https://ucpformat.org/schemas/1.0/root.schema.json")
        _VALIDATOR = jsonschema.Draft202012Validator(root, registry=registry)
    return _VALIDATOR


def _rule_of(error: Any) -> str | None:
    node = error
    while node is not None:
        if isinstance(node.schema, dict) and "x-ucp-rule" in node.schema:
            return str(node.schema["x-ucp-rule"])
        node = node.parent
    return None


def check_schema(root: Any) -> None:
    import jsonschema

    errors = sorted(root_validator().iter_errors(root), key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        leaf = jsonschema.exceptions.best_match(error.context) if error.context else error
        where = "/".join(str(p) for p in leaf.absolute_path)
        raise Refused(_rule_of(leaf) or _rule_of(error),
                      f"the root zarr.json breaks the schema at /{where}: {leaf.message[:200]}")


# -- the checks the schemas cannot express -----------------------------------------------------


# Floating-point formats of Table 1: exponent bits, mantissa bits, bias, special values
# ("ieee": infinities and NaNs in the all-ones exponent; "fn": the all-ones exponent holds
# finite values but S.1111.111; "fnuz": no infinities, no negative zero, NaN 0x80;
# "e8m0": an exponent only).
FLOATS: dict[str, tuple[int, int, int, str]] = {
    "float16": (5, 10, 15, "ieee"), "float32": (8, 23, 127, "ieee"),
    "float64": (11, 52, 1023, "ieee"), "bfloat16": (8, 7, 127, "ieee"),
    "float8_e5m2": (5, 2, 15, "ieee"), "float8_e4m3fn": (4, 3, 7, "fn"),
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"), "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
    "float8_e8m0fnu": (8, 0, 127, "e8m0"),
}
# The bits of "NaN" (UCP-1.0-R037)
NAN = {"float16": 0x7E00, "float32": 0x7FC00000, "float64": 0x7FF8000000000000,
       "bfloat16": 0x7FC0, "float8_e5m2": 0x7E, "float8_e4m3fn": 0x7F,
       "float8_e4m3fnuz": 0x80, "float8_e5m2fnuz": 0x80, "float8_e8m0fnu": 0xFF}


def largest_finite(dtype: str) -> Fraction:
    ebits, mbits, bias, flavour = FLOATS[dtype]
    top = (1 << ebits) - 1  # the all-ones exponent
    if flavour == "e8m0":
        return Fraction(2) ** (top - 1 - bias)
    if flavour == "ieee":
        return (2 - Fraction(1, 1 << mbits)) * Fraction(2) ** (top - 1 - bias)
    if flavour == "fn":  # S.1111.111 is the NaN
        return (2 - Fraction(2, 1 << mbits)) * Fraction(2) ** (top - bias)
    return (2 - Fraction(1, 1 << mbits)) * Fraction(2) ** (top - bias)  # fnuz


def number_bits(dtype: str, number: float) -> int | None:
    """UCP-1.0-R036: the bits of the type's value nearest to ``number`` (a binary64 already), ties
    to even; None when that is beyond the type's finite range (or, for e8m0, not 2**k)."""
    ebits, mbits, bias, flavour = FLOATS[dtype]
    sign = 1 if math.copysign(1.0, number) < 0 else 0
    if flavour == "e8m0":
        mantissa, exponent = math.frexp(number)
        ok = mantissa == 0.5 and -127 <= exponent - 1 <= 127
        return exponent - 1 + bias if ok else None
    if number == 0:
        return 0 if flavour == "fnuz" else sign << (ebits + mbits)
    magnitude = Fraction(abs(number))
    exponent = max(math.frexp(abs(number))[1] - 1, 1 - bias)  # subnormals: the least one
    units = magnitude / Fraction(2) ** (exponent - mbits)
    n = math.floor(units)
    if units - n > Fraction(1, 2) or (units - n == Fraction(1, 2) and n % 2):
        n += 1
    if n == 1 << (mbits + 1):  # the rounding carried into the next binade
        n, exponent = n // 2, exponent + 1
    if n * Fraction(2) ** (exponent - mbits) > largest_finite(dtype):
        return None
    if n == 0:
        return 0 if flavour == "fnuz" else sign << (ebits + mbits)
    if n < 1 << mbits:  # subnormal
        return sign << (ebits + mbits) | n
    return sign << (ebits + mbits) | (exponent + bias) << mbits | (n - (1 << mbits))


def fill_json(dtype: str, value: Any, where: str) -> Any:
    """The fill value checked (UCP-1.0-R026, UCP-1.0-R036 to UCP-1.0-R038), as tensorstore is
    handed it: hexadecimal
    bits for floating-point types, since tensorstore rounds some JSON numbers otherwise (it
    reads 465 as the NaN of float8_e4m3fn, 3.0 as 2**-62 for float8_e8m0fnu)."""
    size, kind, largest, has_inf = TYPES[dtype]

    def bad(why: str, rule: str = "026") -> Refused:
        return Refused(R + rule, f"{where}: fill_value {value!r} for {dtype}: {why}")

    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("not true or false")
        return value
    if kind in ("int", "uint"):
        low = 0 if kind == "uint" else -largest - 1
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= largest:
            raise bad("not an integer of the type's range")
        return value
    if kind == "complex":
        if not isinstance(value, list) or len(value) != 2:
            raise bad("not [real, imag]")
        part = "float32" if dtype == "complex64" else "float64"
        return [fill_json(part, v, where) for v in value]
    if isinstance(value, str):
        if value[:2] in ("0x", "0X"):
            if value[1] != "x" or not re.fullmatch(f"[0-9a-fA-F]{{{2 * size}}}", value[2:]):
                raise bad(f"not 0x and {2 * size} hexadecimal digits", "038")
            bits = int(value[2:], 16)
        elif value == "NaN":
            bits = NAN[dtype]
        elif value in ("Infinity", "-Infinity"):
            if not has_inf:
                raise bad("the type has no infinities")
            ebits, mbits, _, _ = FLOATS[dtype]
            bits = ((1 << ebits) - 1) << mbits | (1 << (ebits + mbits) if value[0] == "-" else 0)
        else:
            raise bad("not a number, NaN, Infinity or 0x...")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise bad("not a number")
    else:
        try:
            number = float(value)  # the nearest binary64 first
        except OverflowError:
            raise bad("beyond the type's finite range", "036") from None
        found = number_bits(dtype, number)
        if found is None:
            raise bad("beyond the type's finite range once rounded, or (for float8_e8m0fnu) "
                      "not a power of two", "036")
        bits = found
    return f"0x{bits:0{2 * size}x}"


def chain_of(doc: Mapping[str, Any]) -> tuple[list[Any], list[int] | None]:
    """(chunk codec chain, inner chunk shape or None) of an array."""
    codecs = doc["codecs"]
    if codecs and codecs[0].get("name") == "sharding_indexed":
        cfg = codecs[0]["configuration"]
        return cfg["codecs"], list(cfg["chunk_shape"])
    return codecs, None


def check_array(path: str, doc: Mapping[str, Any]) -> Any:
    """Check what the schema cannot; the fill value as tensorstore is to read it."""
    dtype = doc["data_type"]
    size = TYPES[dtype][0]
    shape = doc["shape"]
    grid = doc["chunk_grid"]["configuration"]["chunk_shape"]
    if len(grid) != len(shape):
        raise Refused(R + "021", f"{path}: chunk shape and shape differ in rank")
    if math.prod(shape) * size > 2**63 - 1:
        raise Refused(R + "027", f"{path}: shape {shape} describes more than 2**63-1 bytes")
    chain, inner = chain_of(doc)
    if inner is not None:
        if len(inner) != len(shape) or any(g % c for g, c in zip(grid, inner, strict=True)):
            raise Refused(R + "028", f"{path}: shard {grid} is not a multiple of {inner}")
        if math.prod(g // c for g, c in zip(grid, inner, strict=True)) > 2**24:
            raise Refused(R + "028", f"{path}: a shard of more than 2**24 inner chunks")
    endian = (chain[0].get("configuration") or {}).get("endian")
    if size == 1 and endian is not None:
        raise Refused(R + "023", f"{path}: a 1-byte type declares endian")
    if size > 1 and endian != "little":
        raise Refused(R + "023", f"{path}: {dtype} must be little-endian, got {endian!r}")
    if not chain or chain[-1].get("name") != "crc32c":
        raise Refused(R + "040", f"{path}: the chunk chain does not end with crc32c")
    return fill_json(dtype, doc["fill_value"], path)


def check_zstd(data: bytes, nbytes: int, where: str) -> None:
    """UCP-1.0-R047: a zstd chunk is one frame (RFC 8878) without a dictionary, declaring a content
    size of ``nbytes`` and a window no larger; tensorstore decodes other frames too."""
    def refuse(why: str) -> Refused:
        return Refused(R + "047", f"{where}: {why}")

    if len(data) < 6 or int.from_bytes(data[:4], "little") != 0xFD2FB528:
        raise refuse("not one zstd frame")
    fhd = data[4]
    single, fcs_flag = fhd >> 5 & 1, fhd >> 6
    if fhd & 3:
        raise refuse("the zstd frame names a dictionary")
    if not single and not fcs_flag:
        raise refuse("the zstd frame does not declare its content size")
    pos = 5
    window = None
    if not single:
        base = 1 << (10 + (data[pos] >> 3))
        window = base + (base >> 3) * (data[pos] & 7)
        pos += 1
    length = (1 if single else 0, 2, 4, 8)[fcs_flag]
    content = int.from_bytes(data[pos:pos + length], "little") + (256 if length == 2 else 0)
    pos += length
    if content != nbytes or (window is not None and window > nbytes):
        raise refuse(f"the zstd frame declares {content} bytes and a window of "
                     f"{window or content}; the chunk is {nbytes} bytes")
    last = 0
    while not last:
        if pos + 3 > len(data):
            raise refuse("a zstd block header is cut short")
        header = int.from_bytes(data[pos:pos + 3], "little")
        last = header & 1
        pos += 3 + (1 if (header >> 1) & 3 == 1 else header >> 3)
    pos += 4 if fhd & 4 else 0
    if pos != len(data):
        raise refuse("the chunk is not exactly one zstd frame")


class Checkpoint:
    """An opened checkpoint: its root, checked; arrays opened with tensorstore on demand."""

    def __init__(self, location: str | Path) -> None:
        self.root_dir = Path(location).resolve()
        root_file = self.root_dir / "zarr.json"
        if not root_file.is_file():
            raise Refused(R + "051", "no root zarr.json: not a committed checkpoint")
        data = root_file.read_bytes()
        self.root = strict_json(data, "the root zarr.json")
        if not isinstance(self.root, dict):
            raise Refused(R + "001", "the root zarr.json is not an object")
        ucp = (self.root.get("attributes") or {}).get("ucp")
        version = ucp.get("version") if isinstance(ucp, dict) else None
        if isinstance(version, str) and VERSION.match(version) and version.split(".")[0] != "1":
            raise Refused(R + "060", f"format version {version}: this reader reads 1.x only")
        check_root_digest(data, self.root)
        check_schema(self.root)
        ucp = self.root["attributes"]["ucp"]
        if ucp.get("must_understand"):
            raise Refused(R + "061", f"features this reader lacks: {ucp['must_understand']}")
        self.nodes: dict[str, dict[str, Any]] = dict(
            self.root["consolidated_metadata"]["metadata"])
        self.fills: dict[str, Any] = {}
        for path, node in self.nodes.items():
            for part in path.split("/"):
                check_node_name(part)
            parent = path.rpartition("/")[0]
            if parent and (parent not in self.nodes
                           or self.nodes[parent].get("node_type") != "group"):
                raise Refused(R + "005", f"{path}: its parent group {parent!r} is missing")
            if node.get("node_type") == "array":
                self.fills[path] = check_array(path, node)
        self._open: dict[str, Any] = {}

    def arrays(self) -> dict[str, dict[str, Any]]:
        return {p: n for p, n in self.nodes.items() if n.get("node_type") == "array"}

    def store(self, path: str) -> Any:
        if path not in self._open:
            # the checked metadata of the root, with the fill value as its bits
            metadata = {k: v for k, v in self.nodes[path].items()
                        if k not in ("zarr_format", "node_type")}
            metadata["fill_value"] = self.fills[path]
            self._open[path] = ts.open({
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": str(self.root_dir / path) + "/"},
                "metadata": metadata,
                "assume_metadata": True,
                "open": True,
            }).result()
        return self._open[path]

    # -- chunk presence (UCP-1.0-R031) and safe files (UCP-1.0-R091)

    def _file(self, key: str) -> Path | None:
        path = self.root_dir / key
        if not os.path.lexists(path):
            parts = key.split("/")
            for i in range(1, len(parts)):  # a file where a directory should be (R099)
                above = self.root_dir.joinpath(*parts[:i])
                if os.path.lexists(above) and not above.is_dir():
                    raise Refused(R + "099", f"{key} cannot be read: {'/'.join(parts[:i])} is "
                                             "not a directory")
            return None
        real = Path(os.path.realpath(path))
        if real != self.root_dir and self.root_dir not in real.parents:
            raise Refused(R + "091", f"{key} is a link to {real}, outside the checkpoint")
        parts = key.split("/")
        for i in range(len(parts)):  # no link under a checkpoint is followed (R089)
            if (self.root_dir.joinpath(*parts[: i + 1])).is_symlink():
                raise Refused(R + "089", f"{'/'.join(parts[: i + 1])} is a symbolic link")
        if not real.is_file():
            raise Refused(R + "091", f"{key} is not a regular file")
        return path

    def check_present(self, path: str, lo: Sequence[int], hi: Sequence[int]) -> None:
        """Every stored object and inner chunk the box [lo, hi) needs exists (UCP-1.0-R031), lies
        before its shard's index (UCP-1.0-R048), and, zstd-compressed, is one frame that declares
        its size (UCP-1.0-R047), within the bound of UCP-1.0-R098 (CRC32C included):
        tensorstore checks none of these."""
        node = self.nodes[path]
        shape = node["shape"]
        if any(b <= a for a, b in zip(lo, hi, strict=True)):
            return
        sparse = bool(((node.get("attributes") or {}).get("ucp") or {}).get("sparse", False))
        grid = node["chunk_grid"]["configuration"]["chunk_shape"]
        chain, inner = chain_of(node)
        zstd = any(c.get("name") == "zstd" for c in chain)
        chunk_bytes = math.prod(inner or grid) * TYPES[node["data_type"]][0]
        for coords in _product([range(a // g, -(-b // g)) for a, b, g in zip(lo, hi, grid,
                                                                              strict=True)]):
            key = f"{path}/c" + "".join(f"/{c}" for c in coords)
            file = self._file(key)
            if file is None:
                if sparse:
                    continue
                raise Refused(R + "031", f"{path}: stored object {key} is missing (never read "
                                         "as fill values)")
            if inner is None:
                # the stored size, its CRC32C included, is at most twice the decoded
                # size plus 64 KiB (UCP-1.0-R098): tensorstore reads whatever is there
                if file.stat().st_size > 2 * chunk_bytes + 65536:
                    raise Refused(R + "098", f"{key}: stored in {file.stat().st_size} bytes, "
                                             "more than twice its size plus 64 KiB")
                if zstd:
                    check_zstd(file.read_bytes()[:-4], chunk_bytes, key)
                continue
            self._check_index(path, key, file, coords, grid, inner, shape, lo, hi,
                              sparse=sparse, zstd=zstd, chunk_bytes=chunk_bytes)

    def _check_index(self, path: str, key: str, file: Path, coords: Sequence[int],
                     grid: Sequence[int], inner: Sequence[int], shape: Sequence[int],
                     lo: Sequence[int], hi: Sequence[int], *, sparse: bool, zstd: bool,
                     chunk_bytes: int) -> None:
        per = [g // c for g, c in zip(grid, inner, strict=True)]
        n = math.prod(per)
        size = file.stat().st_size
        if size < 16 * n + 4:
            raise Refused(R + "041", f"{key}: shard shorter than its index")
        with open(file, "rb") as f:
            f.seek(size - 16 * n - 4)
            raw = f.read(16 * n + 4)
        body, stored = raw[:-4], raw[-4:]
        if crc32c(body).to_bytes(4, "little") != stored:
            raise Refused(R + "041", f"{key}: the shard index fails its CRC32C check")
        index = np.frombuffer(body, dtype="<u8").reshape(n, 2)
        origin = [c * g for c, g in zip(coords, grid, strict=True)]
        for i, local in enumerate(_product([range(p) for p in per])):
            start = [o + j * c for o, j, c in zip(origin, local, inner, strict=True)]
            if any(s >= e for s, e in zip(start, shape, strict=True)):
                continue  # wholly outside the array: never stored
            if any(s >= b or s + c <= a
                   for s, c, a, b in zip(start, inner, lo, hi, strict=True)):
                continue  # not needed for this box
            offset, nbytes = int(index[i, 0]), int(index[i, 1])
            if offset == EMPTY and nbytes == EMPTY:
                if sparse:
                    continue
                raise Refused(R + "031", f"{path}: inner chunk {list(local)} of {key} was "
                                         "never written")
            if offset + nbytes > size:
                raise Refused(R + "094", f"{key}: inner chunk {list(local)} reaches beyond "
                                         "the end of its shard")
            if nbytes > 2 * chunk_bytes + 65536:
                raise Refused(R + "098", f"{key}: inner chunk {list(local)} is stored in "
                                         f"{nbytes} bytes, more than twice its size plus 64 KiB")
            if offset + nbytes > size - 16 * n - 4:
                raise Refused(R + "048", f"{key}: inner chunk {list(local)} reaches into the "
                                         "shard index")
            if zstd and nbytes >= 4:
                with open(file, "rb") as f:
                    f.seek(offset)
                    check_zstd(f.read(nbytes - 4), chunk_bytes, f"{key} {list(local)}")

    # -- reading -----------------------------------------------------------------------------

    def read(self, path: str, selection: Sequence[Sequence[int]] | None = None) -> Any:
        node = self.nodes.get(path)
        if node is None or node.get("node_type") != "array":
            raise Refused(None, f"no tensor {path!r}")
        if node["data_type"] in WITHOUT:
            raise Refused("UCP-1.0-R092", f"{path}: this reader does not implement the data "
                                          f"type {node['data_type']}")
        shape = node["shape"]
        if selection is None:
            selection = [[0, n, 1] for n in shape]
        lo, hi = [], []
        for (a, b, s), n in zip(selection, shape, strict=True):
            if not (0 <= a <= b <= n and s >= 1):
                raise Refused(None, f"{path}: selection {selection} outside {shape}")
            picked = range(a, b, s)
            lo.append(picked[0] if picked else a)
            hi.append(picked[-1] + 1 if picked else a)
        self.check_present(path, lo, hi)
        if any(b <= a for a, b in zip(lo, hi, strict=True)):
            return np.zeros([len(range(a, b, s)) for a, b, s in selection],
                            dtype=self.store(path).dtype.numpy_dtype)
        index = tuple(slice(a, b, s) for a, b, s in selection)
        try:
            return self.store(path)[index].read().result()
        except Exception as exc:  # tensorstore reports damage as ValueError and others
            rule = "008" if "Invalid bool value" in str(exc) else "041"
            raise Refused(R + rule, f"{path}: {str(exc)[:300]}") from None


def _product(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head, *tail)


_CRC_TABLE: list[int] = []


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected 0x82F63B78), for shard indexes."""
    if not _CRC_TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _CRC_TABLE.append(c)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def digest(array: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes(order="C")).hexdigest()


# -- target layouts (spec/ucp-1.0-layout.md, section 2) -----------------------------------------

Segment = tuple[int, int, int]  # (local start, consolidated start, length)


def _restrict(length: int, segs: list[Segment], lo: int, hi: int) -> tuple[int, list[Segment]]:
    out = []
    for ls, gs, n in segs:
        a, b = max(ls, lo), min(ls + n, hi)
        if a < b:
            out.append((a - lo, gs + a - ls, b - a))
    return hi - lo, out


def local_map(shape: Sequence[int], layout: Mapping[str, Any], cfg: Mapping[str, Any]
              ) -> list[tuple[int, list[Segment]]] | None:
    """Per dimension (local length, segments) of a rank's local tensor; None: not held."""
    tp, tpr = int(cfg.get("tp", 1)), int(cfg.get("tp_rank", 0))
    pp, ppr = int(cfg.get("pp", 1)), int(cfg.get("pp_rank", 0))
    ep, epr = int(cfg.get("ep", 1)), int(cfg.get("ep_rank", 0))
    for degree, rank in ((tp, tpr), (pp, ppr), (ep, epr)):
        if degree < 1 or not 0 <= rank < degree:
            raise Refused(R + "110", f"degree {degree}, rank {rank}: not a parallel layout")
    dims: list[tuple[int, list[Segment]]] = [(n, [(0, 0, n)] if n else []) for n in shape]
    experts, expert = layout.get("experts"), layout.get("expert")
    num_experts = cfg.get("num_experts")
    if experts is not None:  # a stacked tensor holds every expert of the model (UCP-1.0-R117)
        d, count = experts["dim"], shape[experts["dim"]]
        if count % ep or (num_experts is not None and num_experts != count):
            raise Refused(R + "111", f"ep={ep}, num_experts={num_experts}: {count} experts")
        dims[d] = _restrict(*dims[d], epr * count // ep, (epr + 1) * count // ep)
    if expert is not None:  # rank floor(e / (E / ep)), E from the configuration (UCP-1.0-R117)
        num = num_experts if num_experts is not None else (expert + 1 if ep == 1 else None)
        if num is None or num % ep or expert >= num:
            raise Refused(R + "111", f"ep={ep} and num_experts={num} cannot place expert "
                                     f"{expert}")
    held = expert is None or expert // (num // ep) == epr
    layer, layers = layout.get("layer"), layout.get("layers")
    pp_layers = cfg.get("pp_layers")
    if pp_layers is not None and len(pp_layers) != pp:
        raise Refused(R + "112", f"pp_layers {pp_layers} is not one count per stage")
    num_layers = cfg.get("num_layers")  # (UCP-1.0-R116)
    if num_layers is None and pp_layers is not None:
        num_layers = sum(pp_layers)
    if num_layers is None and layers is not None:
        num_layers = shape[layers["dim"]]  # a stacked tensor holds every layer
    if layers is not None and num_layers != shape[layers["dim"]]:
        raise Refused(R + "112", f"num_layers={num_layers}, {shape[layers['dim']]} stacked")
    if layer is None and layers is None:  # placed by the stage convention (UCP-1.0-R115)
        stage = cfg.get("stage", "all")
        if not (stage == "all" or (stage == "first" and ppr == 0)
                or (stage == "last" and ppr == pp - 1)
                or (stage == "first_and_last" and ppr in (0, pp - 1))):
            return None
    elif num_layers is None:
        if pp > 1:
            raise Refused(R + "112", f"pp={pp} needs the model's number of layers")
    else:
        counts = pp_layers
        if counts is None:
            if num_layers % pp:
                raise Refused(R + "112", f"{num_layers} layers do not split over pp={pp}")
            counts = [num_layers // pp] * pp
        elif sum(counts) != num_layers:
            raise Refused(R + "112", f"pp_layers {counts} do not sum to {num_layers}")
        start = sum(counts[:ppr])
        stop = start + counts[ppr]
        if layer is not None:
            if not 0 <= layer < num_layers:
                raise Refused(R + "112", f"layer {layer} is outside the model")
            if not start <= layer < stop:
                return None
        else:
            d = layers["dim"]
            dims[d] = _restrict(*dims[d], start, stop)
    if not held:  # another expert-parallel rank's expert
        return None
    tp_dim = (layout.get("tp") or {}).get("dim")
    vocab_dim = (layout.get("vocab") or {}).get("dim")
    parts = layout.get("parts") or []
    multiple = int(cfg.get("vocab_multiple", 1))
    if tp_dim is not None and (tp > 1 or vocab_dim is not None or parts):
        n = shape[tp_dim]
        if vocab_dim == tp_dim:
            step = multiple * tp
            padded = -(-n // step) * step
            per = padded // tp
            start = tpr * per
            segs = [(0, start, min(start + per, n) - start)] if start < n else []
            dims[tp_dim] = (per, segs)
        elif not parts:
            if n % tp:
                raise Refused(R + "110", f"tp={tp} does not divide {n}")
            dims[tp_dim] = _restrict(*dims[tp_dim], tpr * n // tp, (tpr + 1) * n // tp)
        else:
            groups = layout.get("groups") or tp
            if groups % tp or any(p["size"] % groups for p in parts):
                raise Refused(R + "110", f"tp={tp} cannot split {groups} groups of the parts")
            mine = range(tpr * groups // tp, (tpr + 1) * groups // tp)
            offsets, off = [], 0
            for p in parts:
                offsets.append((p["size"], off))
                off += p["size"]
            if cfg.get("fused_order", "part-major") == "group-major":
                order = [(g, size, o) for g in mine for size, o in offsets]
            else:
                order = [(g, size, o) for size, o in offsets for g in mine]
            segs, local = [], 0
            for g, size, o in order:
                gsize = size // groups
                segs.append((local, o + g * gsize, gsize))
                local += gsize
            dims[tp_dim] = (local, segs)
    elif vocab_dim is not None:  # not split, padded as the model's vocabulary (UCP-1.0-R118)
        n = shape[vocab_dim]
        padded = -(-n // (multiple * tp)) * (multiple * tp)
        dims[vocab_dim] = (padded, [(0, 0, n)] if n else [])
    return dims


def read_target(ckpt: Checkpoint, target: Mapping[str, Any]) -> dict[str, Any]:
    path = target["tensor"]
    node = ckpt.nodes.get(path)
    if node is None or node.get("node_type") != "array":
        raise Refused(None, f"no tensor {path!r}")
    layout = ((node.get("attributes") or {}).get("ucp") or {}).get("layout") or {}
    dims = local_map(node["shape"], layout, target.get("config", {}))
    if dims is None:
        return {"held": False}
    dtype = ckpt.store(path).dtype.numpy_dtype
    local = np.zeros([length for length, _ in dims], dtype=dtype)
    for combo in _product([range(len(segs)) for _, segs in dims]):
        src, dst = [], []
        for (_, segs), k in zip(dims, combo, strict=True):
            ls, gs, n = segs[k]
            src.append([gs, gs + n, 1])
            dst.append(slice(ls, ls + n))
        local[tuple(dst)] = ckpt.read(path, src)
    return {"held": True, "shape": list(local.shape), "sha256": digest(local)}


# -- the adapter ---------------------------------------------------------------------------------


def respond(checkpoint: str, request: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    try:
        ckpt = Checkpoint(checkpoint)
    except Refused as exc:
        return {"error": exc.to_json()}, True
    except (KeyError, TypeError, AttributeError) as exc:  # a shape the schema let through
        return {"error": {"message": f"malformed metadata: {exc!r}"}}, True
    refused = False
    tensors: dict[str, Any] = {p: {"dtype": n["data_type"], "shape": n["shape"]}
                               for p, n in ckpt.arrays().items()}
    for path, req in request.get("tensors", {}).items():
        entry = tensors.setdefault(path, {})
        try:
            if req.get("whole"):
                entry["sha256"] = digest(ckpt.read(path))
            entry["slices"] = [digest(ckpt.read(path, sel)) for sel in req.get("slices", [])]
        except Refused as exc:
            entry.pop("sha256", None)
            entry.pop("slices", None)
            entry["error"] = exc.to_json()
            refused = True
    response: dict[str, Any] = {"tensors": tensors}
    ucp = ckpt.root["attributes"]["ucp"]
    values = {"": ucp.get("values", {})}
    for path, node in sorted(ckpt.nodes.items()):
        if node.get("node_type") == "group":
            values[path] = ((node.get("attributes") or {}).get("ucp") or {}).get("values", {})
    response["values"] = values
    response["metadata"] = ucp.get("metadata", {})
    if request.get("targets"):
        targets = {}
        for target in request["targets"]:
            try:
                targets[target["id"]] = read_target(ckpt, target)
            except Refused as exc:
                targets[target["id"]] = {"error": exc.to_json()}
        response["targets"] = targets
    return response, refused


def capabilities() -> dict[str, Any]:
    return {
        "name": "tensorstore-reader (conformance/adapters)",
        "version": "1.0",
        "roles": ["reader"],
        "data_types": [t for t in TYPES if t not in WITHOUT],
        "features": ["batch", "layout"],
    }


def main(argv: Sequence[str]) -> int:
    def emit(doc: Any) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")

    if argv[:1] == ["capabilities"]:
        emit(capabilities())
        return 0
    if argv[:1] == ["read"] and len(argv) == 3:
        response, refused = respond(argv[1], json.loads(Path(argv[2]).read_text("utf-8")))
        emit(response)
        return 1 if refused else 0
    if argv[:1] == ["read-batch"] and len(argv) == 2:
        batch = json.loads(Path(argv[1]).read_text("utf-8"))
        emit({"results": {item["id"]: respond(item["checkpoint"], item["request"])[0]
                          for item in batch["cases"]}})
        return 0
    sys.stderr.write("usage: tensorstore_reader.py capabilities | read CHECKPOINT REQUEST | "
                     "read-batch BATCH\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
