#!/usr/bin/env python3
"""An independent UCP 1.0 exporter built on zarr-python, numpy and json, from the spec's text.

It does not import ucpformat (a test checks that). zarr-python writes each array (every
chunk, even all-zero ones: ``write_empty_chunks``, spec UCP-1.0-R030), with the ``bytes`` and
``crc32c`` codecs (UCP-1.0-R022, UCP-1.0-R023, UCP-1.0-R040); this file adds what zarr-python does
not do:

* node names escaped as spec section 6 says (UCP-1.0-R010);
* per-rank local tensors of a Megatron-style tensor-parallel layout or of DTensor
  placements consolidated into full, unpadded tensors (spec/ucp-1.0-layout.md): split
  dimensions, fused parts in part-major or group-major order, vocabulary padding dropped
  (UCP-1.0-R113); a tensor the ranks do not cover is refused before anything is written
  (UCP-1.0-R131);
* the group documents, the manifest with SHA-256 digests (UCP-1.0-R042) and, last, the root
  ``zarr.json`` with the consolidated metadata, written atomically (UCP-1.0-R050 to UCP-1.0-R055); a
  committed checkpoint at the destination is never touched (UCP-1.0-R053).

Data types: those zarr-python 3.1 knows without plugins (no bfloat16, no float8), which
the capabilities say, so the suite leaves the others out.

Usage (the adapter contract of spec/ucp-1.0-conformance.md)::

    zarr_exporter.py capabilities
    zarr_exporter.py write SCENARIO_JSON OUT_DIR
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec

R = "UCP-1.0-R"
SAFE = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
TYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
         "float16", "float32", "float64", "complex64", "complex128")
MASK = (1 << 64) - 1

#: Knobs the deliberately broken exporters of tests/conformance/broken turn.
OPTIONS = {"write_empty_chunks": True, "drop_vocab_padding": True, "root_last": True,
           "check_coverage": True, "rewrite": False}


#: The in-progress marker (R056), created exclusively as this writer's claim (R059).
MARKER = "write-in-progress.ucp.json"


class Refused(Exception):
    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule


def escape(name: str) -> str:
    """The node name of a logical name (spec section 6, UCP-1.0-R010)."""
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


def splitmix64(seed: int, shape: Sequence[int], dtype: np.dtype[Any], is_bool: bool
               ) -> np.ndarray[Any, Any]:
    """The spec's deterministic contents (UCP-1.0-R240): a stream of splitmix64(seed + k) words."""
    n = math.prod(shape)
    nbytes = n * dtype.itemsize
    k = np.arange(-(-nbytes // 8), dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = k + np.uint64(seed & MASK) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    raw = z.astype("<u8").tobytes()[:nbytes]
    if is_bool:
        return (np.frombuffer(raw, dtype=np.uint8) & 1).astype(bool).reshape(shape)
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def numpy_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(name).newbyteorder("<") if name != "bool" else np.dtype(bool)


# -- consolidating local tensors -----------------------------------------------------------------

Segment = tuple[int, int, int]  # (local start, consolidated start, length)


def torch_chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    size = -(-n // parts) if n else 0
    lo = min(index * size, n)
    return lo, min(lo + size, n)


def restrict(segs: list[Segment], lo: int, hi: int) -> list[Segment]:
    out = []
    for ls, gs, n in segs:
        a, b = max(ls, lo), min(ls + n, hi)
        if a < b:
            out.append((a - lo, gs + a - ls, b - a))
    return out


def megatron_dims(shape: Sequence[int], layout: Mapping[str, Any], source: Mapping[str, Any],
                  rank: int) -> list[list[Segment]]:
    """Segments of each dimension of tensor-parallel rank ``rank``'s local tensor."""
    tp = int(source.get("tp", 1))
    dims: list[list[Segment]] = [[(0, 0, n)] if n else [] for n in shape]
    tp_dim = (layout.get("tp") or {}).get("dim")
    vocab_dim = (layout.get("vocab") or {}).get("dim")
    parts = layout.get("parts") or []
    multiple = int(source.get("vocab_multiple", 1))
    if tp_dim is None or not (tp > 1 or vocab_dim is not None or parts):
        return dims
    n = shape[tp_dim]
    if vocab_dim == tp_dim:
        step = multiple * tp
        per = -(-n // step) * step // tp
        start = rank * per
        if OPTIONS["drop_vocab_padding"]:
            dims[tp_dim] = [(0, start, min(start + per, n) - start)] if start < n else []
        else:  # the broken exporter: padding rows become rows of the tensor
            dims[tp_dim] = [(0, start, per)]
    elif not parts:
        dims[tp_dim] = restrict(dims[tp_dim], rank * n // tp, (rank + 1) * n // tp)
    else:
        groups = layout.get("groups") or tp
        mine = range(rank * groups // tp, (rank + 1) * groups // tp)
        offsets, off = [], 0
        for p in parts:
            offsets.append((p["size"], off))
            off += p["size"]
        if source.get("fused_order", "part-major") == "group-major":
            order = [(g, size, o) for g in mine for size, o in offsets]
        else:
            order = [(g, size, o) for size, o in offsets for g in mine]
        segs, local = [], 0
        for g, size, o in order:
            segs.append((local, o + g * (size // groups), size // groups))
            local += size // groups
        dims[tp_dim] = segs
    return dims


def dtensor_dims(shape: Sequence[int], source: Mapping[str, Any], rank: int
                 ) -> list[list[Segment]]:
    """Segments of each dimension of mesh rank ``rank`` (C order over the mesh)."""
    mesh = [int(m) for m in source["mesh"]]
    coords = []
    rest = rank
    for size in reversed(mesh):
        coords.append(rest % size)
        rest //= size
    coords.reverse()
    dims: list[tuple[int, list[Segment]]] = [(n, [(0, 0, n)] if n else []) for n in shape]
    for size, placement, c in zip(mesh, source["placements"], coords, strict=True):
        if "shard" in placement:
            d = placement["shard"]
            length, segs = dims[d]
            lo, hi = torch_chunk(length, size, c)
            dims[d] = (hi - lo, restrict(segs, lo, hi))
        elif "strided_shard" in placement:
            d, k = placement["strided_shard"], placement["split_factor"]
            length, segs = dims[d]
            new: list[Segment] = []
            total = 0
            for b in range(k):
                b_lo, b_hi = torch_chunk(length, k, b)
                lo, hi = torch_chunk(b_hi - b_lo, size, c)
                for ls, gs, n in restrict(segs, b_lo + lo, b_lo + hi):
                    new.append((ls + total, gs, n))
                total += hi - lo
            dims[d] = (total, new)
    return [segs for _, segs in dims]


def consolidate(entry: Mapping[str, Any], base: Path) -> np.ndarray[Any, Any]:
    """The full tensor from the ranks' local files; refuses a tensor they do not cover."""
    dtype = numpy_dtype(entry["dtype"])
    shape = tuple(entry["shape"])
    content = entry["content"]
    source = content["source"]
    layout = (entry.get("ucp") or {}).get("layout") or {}
    if source["kind"] == "megatron" and not OPTIONS["drop_vocab_padding"]:
        vocab_dim = (layout.get("vocab") or {}).get("dim")
        if vocab_dim is not None and content["locals"]:
            padded = content["locals"][0]["shape"][vocab_dim] * int(source.get("tp", 1))
            shape = tuple(padded if d == vocab_dim else n for d, n in enumerate(shape))
    full = np.zeros(shape, dtype=dtype)
    covered = np.zeros(shape, dtype=bool)
    for local in content["locals"]:
        data = np.frombuffer((base / local["file"]).read_bytes(), dtype=dtype)
        data = data.reshape(tuple(local["shape"]))
        rank = int(local["rank"])
        if source["kind"] == "megatron":
            dims = megatron_dims(shape, layout, source, rank)
        elif source["kind"] == "dtensor":
            dims = dtensor_dims(shape, source, rank)
        else:
            raise ValueError(f"unknown source {source['kind']!r}")
        for combo in np.ndindex(*[len(s) for s in dims]) if dims else [()]:
            src, dst = [], []
            for segs, k in zip(dims, combo, strict=True):
                ls, gs, n = segs[k]
                src.append(slice(ls, ls + n))
                dst.append(slice(gs, gs + n))
            full[tuple(dst)] = data[tuple(src)]
            covered[tuple(dst)] = True
    if OPTIONS["check_coverage"] and not covered.all():
        missing = np.argwhere(~covered)[0].tolist()
        raise Refused(R + "131", f"{'/'.join(entry['name'])}: no rank holds element {missing} "
                                 "(and maybe others); nothing was written")
    return full


def tensor_data(entry: Mapping[str, Any], base: Path) -> np.ndarray[Any, Any]:
    content = entry["content"]
    dtype = numpy_dtype(entry["dtype"])
    shape = tuple(entry["shape"])
    if content["generator"] == "splitmix64":
        return splitmix64(int(content["seed"]), shape, dtype, entry["dtype"] == "bool")
    if content["generator"] == "zeros":
        return np.zeros(shape, dtype=dtype)
    return consolidate(entry, base)


# -- writing -------------------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dump(doc: Any) -> bytes:
    return json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False).encode("utf-8")


def seal_root(root: dict[str, Any]) -> bytes:
    """The root's bytes with ``attributes.ucp.root_sha256`` (UCP-1.0-R058): the SHA-256 of
    these bytes in which its own 64 digits are written as ``0``."""
    placeholder = "0" * 64
    root["attributes"]["ucp"]["root_sha256"] = placeholder
    body = _dump(root)
    token = f'"{placeholder}"'.encode()
    pos = body.index(token) + 1
    assert body.find(token, pos) < 0, "64 zeros elsewhere in the root: use another placeholder"
    digest = hashlib.sha256(body).hexdigest().encode()
    return body[:pos] + digest + body[pos + 64 :]


def write_root(out: Path, body: bytes) -> None:
    if not OPTIONS["root_last"]:  # the broken exporter: straight into place
        (out / "zarr.json").write_bytes(body)
        return
    tmp = out / ".zarr.json.tmp"
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / "zarr.json")
    _fsync(out)


def write(scenario_path: Path, out: Path) -> None:
    scenario = json.loads(scenario_path.read_text(encoding="utf-8"))
    base = scenario_path.parent
    if (out / "zarr.json").exists():
        raise Refused(R + "053", f"{out} holds a committed checkpoint; it is left as it is")
    if out.exists() and any(out.iterdir()):
        raise Refused(R + "053", f"{out} is not empty")
    # everything is computed (and refused) before the first byte is written
    tensors = []
    for entry in scenario["tensors"]:
        if entry["dtype"] not in TYPES:
            raise Refused(R + "020", f"{entry['dtype']} is not a data type this exporter writes")
        path = "/".join(escape(n) for n in entry["name"])
        tensors.append((path, entry, tensor_data(entry, base)))
    groups: dict[str, dict[str, Any]] = {}
    for path, _, _ in tensors:
        parts = path.split("/")
        for i in range(1, len(parts)):
            groups.setdefault("/".join(parts[:i]), {})
    root_values: dict[str, Any] = {}
    for group in scenario.get("groups", []):
        ucp = dict(group.get("ucp", {}))
        if group.get("values"):
            ucp["values"] = group["values"]
        if not group["name"]:
            root_values = dict(group.get("values", {}))
            continue
        path = "/".join(escape(n) for n in group["name"])
        groups[path] = ucp
        parts = path.split("/")
        for i in range(1, len(parts)):
            groups.setdefault("/".join(parts[:i]), {})
    out.mkdir(parents=True, exist_ok=True)
    try:  # claim the location: of two writers started at once, only one creates it (R059)
        os.close(os.open(out / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        raise Refused(R + "059", f"another writer is writing into {out}") from None
    if not OPTIONS["root_last"]:
        write_root(out, _dump({"zarr_format": 3, "node_type": "group",
                               "attributes": {"ucp": {"version": "1.0"}}}))
    nodes: dict[str, Any] = {}
    for path, entry, data in tensors:
        shape = tuple(entry["shape"])
        itemsize = data.dtype.itemsize
        chunks = tuple(max(1, n) for n in data.shape) if data.ndim else ()
        if data.nbytes > 1 << 20 and data.ndim:  # about 1 MiB chunks, cut along dimension 0
            rows = max(1, (1 << 20) // max(1, itemsize * math.prod(data.shape[1:])))
            chunks = (rows, *chunks[1:])
        ucp = dict(entry.get("ucp", {}))
        array = zarr.create_array(
            store=str(out / path),
            shape=data.shape,
            dtype=data.dtype,
            chunks=chunks,
            serializer=BytesCodec(endian=None if itemsize == 1 else "little"),
            compressors=[Crc32cCodec()],
            filters=None,
            fill_value=False if entry["dtype"] == "bool" else 0,
            attributes={"ucp": ucp} if ucp else {},
            config={"write_empty_chunks": OPTIONS["write_empty_chunks"]},
        )
        if math.prod(shape):
            array[...] = data
            if OPTIONS["rewrite"]:  # the broken exporter: a second write, a moment later
                time.sleep(0.3)
                array[...] = data
        nodes[path] = json.loads((out / path / "zarr.json").read_text(encoding="utf-8"))
    for path, ucp in groups.items():
        doc = {"zarr_format": 3, "node_type": "group",
               "attributes": {"ucp": ucp} if ucp else {}}
        (out / path).mkdir(parents=True, exist_ok=True)
        (out / path / "zarr.json").write_bytes(_dump(doc))
        nodes[path] = doc
    files = {}
    for dirpath, _, filenames in os.walk(out):
        for name in filenames:
            full = Path(dirpath) / name
            key = full.relative_to(out).as_posix()
            if key in ("zarr.json", MARKER):
                continue
            data = full.read_bytes()
            files[key] = {"nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            _fsync(full)
    ucp_root: dict[str, Any] = {
        "version": "1.0",
        "producer": {"name": "conformance/adapters/zarr_exporter.py",
                     "version": "1.0", "zarr": zarr.__version__},
        "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if scenario.get("metadata"):
        ucp_root["metadata"] = scenario["metadata"]
    if root_values:
        ucp_root["values"] = root_values
    # UCP-1.0-R045: the manifest seals a copy of the root's attributes (without the manifest
    # reference, which cannot hold its own digest)
    manifest = _dump({"hash_algorithm": "sha256", "files": dict(sorted(files.items())),
                      "root_attributes": {"ucp": dict(ucp_root)}})
    with open(out / "manifest.ucp.json", "wb") as f:
        f.write(manifest)
        os.fsync(f.fileno())
    for dirpath, _, _ in os.walk(out):
        _fsync(Path(dirpath))
    ucp_root["manifest"] = {"path": "manifest.ucp.json", "nbytes": len(manifest),
                            "sha256": hashlib.sha256(manifest).hexdigest()}
    root = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": {"ucp": ucp_root},
        "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                  "metadata": dict(sorted(nodes.items()))},
    }
    write_root(out, seal_root(root))
    os.unlink(out / MARKER)


def capabilities() -> dict[str, Any]:
    return {
        "name": "zarr-exporter (conformance/adapters)",
        "version": "1.0",
        "roles": ["writer"],
        "data_types": list(TYPES),
        "features": ["dtensor", "layout"],
    }


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["capabilities"]:
        sys.stdout.write(json.dumps(capabilities()) + "\n")
        return 0
    if argv[:1] == ["write"] and len(argv) == 3:
        try:
            write(Path(argv[1]), Path(argv[2]))
        except Refused as exc:
            sys.stdout.write(json.dumps({"error": {"message": str(exc), "rule": exc.rule}}) + "\n")
            return 1
        return 0
    sys.stderr.write("usage: zarr_exporter.py capabilities | write SCENARIO_JSON OUT_DIR\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
