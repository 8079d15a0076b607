"""The checkpoint manager's step names and its record of the checkpoints it wrote.

One formatter (:func:`step_name`) and its inverse (:func:`parse_step_name`) name every
step's location; the record (``ucp-manager.json`` under the manager's root,
:func:`parse_record`) says which of them the manager saved, each with its root's SHA-256
(optionally sealed by an HMAC, :func:`record_mac`), so that nothing planted beside them is
restored, counted or deleted (:mod:`ucpformat.checkpoint.manager`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import operator
import re
from collections.abc import Mapping
from typing import Any

from ucpformat.errors import ManagerRecordError

_NAME = re.compile(r"step-([0-9]{10,})")

#: The object, beside a checkpoint's location, that holds the metrics it was saved with.
METRICS_SUFFIX = ".metrics.json"
#: The manager's record of the checkpoints it wrote, under its root.
RECORD_KEY = "ucp-manager.json"
#: The largest record read (a record names each checkpoint in about 130 bytes).
MAX_RECORD_BYTES = 16 << 20
#: The ``format`` of the record document.
RECORD_FORMAT = "ucpformat.manager.record/1"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def step_name(step: int) -> str:
    """The name of the location of ``step``: ``step-`` and at least 10 digits (the one
    formatter; :func:`parse_step_name` is its inverse)."""
    if isinstance(step, bool):
        raise ValueError("a step is an integer, not a bool")
    step = operator.index(step)
    if step < 0:
        raise ValueError("steps are non-negative")
    return f"step-{step:010d}"


def parse_step_name(name: str) -> int | None:
    """The step of a location name that :func:`step_name` writes, or None for any other
    name (``step-00000000012``, 11 digits with a leading zero, is not step 12's name)."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_name(step) == name else None


def record_mac(doc: Mapping[str, Any], key: bytes) -> str:
    """The HMAC-SHA256 of a record document under ``key`` (its own ``hmac_sha256`` left out)."""
    body = json.dumps({k: v for k, v in doc.items() if k != "hmac_sha256"},
                      sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def parse_record(body: bytes, key: bytes | None, where: str) -> dict[str, dict[str, Any]]:
    """The checkpoints of a record's bytes, checked (ManagerRecordError if malformed or, with
    ``key``, if its HMAC does not verify)."""

    def bad(why: str) -> ManagerRecordError:
        return ManagerRecordError(f"the record is refused: {why}", path=where)

    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise bad(f"not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
        raise bad(f"not a record of this manager (format {RECORD_FORMAT!r})")
    if key is not None:
        mac = doc.get("hmac_sha256")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, record_mac(doc, key)):
            raise bad("its HMAC does not verify with this manager's record_key (not written "
                      "by it, or changed since)")
    checkpoints = doc.get("checkpoints")
    if not isinstance(checkpoints, dict):
        raise bad("'checkpoints' is not an object")
    out: dict[str, dict[str, Any]] = {}
    for name, entry in checkpoints.items():
        step = parse_step_name(name) if isinstance(name, str) else None
        if (step is None or not isinstance(entry, dict) or entry.get("step") != step
                or type(entry.get("step")) is not int):
            raise bad(f"entry {name!r} is not a step's location name with its step")
        state, digest = entry.get("state"), entry.get("root_sha256")
        if not ((state == "saving" and digest is None)
                or (state == "saved" and isinstance(digest, str) and _SHA256.fullmatch(digest))):
            raise bad(f"entry {name!r}: state must be 'saving' (no root_sha256) or 'saved' "
                      "(with the root's SHA-256)")
        out[name] = {"step": step, "state": state, "root_sha256": digest}
    return out
