"""The JSON Schemas of schemas/<version>/, loaded across files with ``referencing``.

Each failing subschema names its requirement with the annotation ``x-ucp-rule``, so
that every schema violation is reported with the requirement id it breaks.

Documents are checked first by a compiled validator (jsonschema-rs, about 200 times
faster); only a document it does not accept is checked again by ``jsonschema``, whose
verdict and messages are the ones reported. So the compiled validator can only make a
check faster, never weaker, as long as whatever it accepts ``jsonschema`` accepts too
(tests/test_schema_fast_path.py compares the two on every schema and hostile documents).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import jsonschema_rs
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SCHEMA_VERSION = "1.0"
BASE_URI = f"https://ucpformat.org/schemas/{SCHEMA_VERSION}/"
#: Schema file stem for each kind of metadata object.
KINDS = (
    "root", "array", "group", "manifest", "optimizer", "rng", "ranks", "layout", "rules",
    "defs",
    # the conformance suite (spec/ucp-1.0-conformance.md)
    "conformance-capabilities", "conformance-request", "conformance-response",
    "conformance-validation", "conformance-scenario", "conformance-expected",
    "conformance-report", "conformance-coverage",
)


def schema_dir() -> Path:
    """Where the schemas live: packaged copy in a wheel, or the repository's schemas/."""
    here = Path(__file__).resolve().parents[1]  # the ucpformat package
    for candidate in (here / "_schemas" / SCHEMA_VERSION, here.parent / "schemas" / SCHEMA_VERSION):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("ucpformat's JSON Schemas are not installed (schemas/1.0)")


@functools.cache
def registry() -> Registry[Any]:
    resources = []
    for path in sorted(schema_dir().glob("*.schema.json")):
        contents = json.loads(path.read_text(encoding="utf-8"))
        resource = Resource.from_contents(contents, default_specification=DRAFT202012)
        resources.append((contents["$id"], resource))
    return Registry().with_resources(resources)


def schema(kind: str) -> dict[str, Any]:
    """The schema document for ``kind`` (e.g. ``"array"``)."""
    resolved = registry().contents(f"{BASE_URI}{kind}.schema.json")
    assert isinstance(resolved, dict)
    return resolved


#: RFC 3339 ``date-time`` (section 5.6), the only format the schemas use.
DATE_TIME = re.compile(
    r"^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt]([01][0-9]|2[0-3]):[0-5][0-9]:"
    r"([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$"
)


def _format_checker() -> jsonschema.FormatChecker:
    """The schemas' formats, checked the same way whatever else is installed.

    jsonschema's default checker checks ``date-time`` only when the optional package
    rfc3339-validator happens to be installed, so a verdict would depend on the
    environment (the object-storage test server pulls that package in).
    """
    def date_time(value: object) -> bool:
        return not isinstance(value, str) or DATE_TIME.match(value) is not None

    checker = jsonschema.FormatChecker(formats=())
    checker.checks("date-time")(date_time)
    return checker


@functools.cache
def validator(kind: str) -> jsonschema.protocols.Validator:
    cls = jsonschema.Draft202012Validator
    return cls(schema(kind), registry=registry(), format_checker=_format_checker())


@functools.cache
def fast_validator(kind: str) -> jsonschema_rs.Validator:
    """The compiled validator of schema ``kind``, with the same ``date-time`` check; a
    format other than ``date-time`` in a schema is refused here, not ignored."""
    resources = [(uri, registry().contents(uri)) for uri in
                 (f"{BASE_URI}{k}.schema.json" for k in KINDS)]
    return jsonschema_rs.Draft202012Validator(
        schema(kind),
        registry=jsonschema_rs.Registry(resources),
        formats={"date-time": lambda value: DATE_TIME.match(value) is not None},
        validate_formats=True,
        ignore_unknown_formats=False,
    )


def fast_accepts(kind: str, document: Any) -> bool:
    """True if the compiled validator accepts ``document``; False if it does not or
    cannot tell (a value it cannot convert, nesting deeper than it goes)."""
    try:
        return bool(fast_validator(kind).is_valid(document))
    except (ValueError, TypeError, OverflowError, RecursionError):
        return False


@dataclass(frozen=True)
class SchemaViolation:
    """One schema failure: where in the document, what, and which requirement."""

    rule: str | None
    pointer: str
    message: str


def _rule_of(error: jsonschema.ValidationError) -> str | None:
    # The failing subschema, then the contexts it was reached through.
    node: jsonschema.ValidationError | None = error
    while node is not None:
        sch = node.schema
        if isinstance(sch, dict) and "x-ucp-rule" in sch:
            return str(sch["x-ucp-rule"])
        node = node.parent
    return None


def _leaves(error: jsonschema.ValidationError) -> Iterator[jsonschema.ValidationError]:
    """The most specific errors: for oneOf/anyOf, the best matching branch's errors."""
    if error.context:
        best = jsonschema.exceptions.best_match(error.context)
        if best is not None and best is not error:
            yield from _leaves(best)
            return
    yield error


def violations(kind: str, document: Any) -> list[SchemaViolation]:
    """Every violation of schema ``kind`` by ``document`` (empty: valid)."""
    if fast_accepts(kind, document):
        return []
    out = []
    for error in validator(kind).iter_errors(document):
        for leaf in _leaves(error):
            rule = _rule_of(leaf) or _rule_of(error)
            pointer = "/" + "/".join(str(p) for p in leaf.absolute_path)
            out.append(SchemaViolation(rule, pointer, leaf.message[:500]))
    return out


def is_valid(kind: str, document: Any) -> bool:
    return fast_accepts(kind, document) or bool(validator(kind).is_valid(document))
