"""Broken: JSON values printed as JavaScript's JSON.stringify prints them.

The tensorstore reader, its values and metadata passed through a binary64 round trip
that prints integral numbers without a fraction: 1.0 becomes 1 and -0.0 becomes 0 (a
comparison with Python's ``==`` takes both for the stored value). The suite must report
UCP-1.0-R211, since R073 keeps these values apart.
"""

import sys
from typing import Any

from _load import adapter


def stringified(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: stringified(v) for k, v in value.items()}
    if isinstance(value, list):
        return [stringified(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


reader = adapter("tensorstore_reader")
respond = reader.respond


def loose(checkpoint: str, request: Any) -> Any:
    response, refused = respond(checkpoint, request)
    for key in ("values", "metadata"):
        if key in response:
            response[key] = stringified(response[key])
    return response, refused


reader.respond = loose
sys.exit(reader.main(sys.argv[1:]))
