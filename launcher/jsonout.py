"""JSON that every parser reads: a figure that does not exist (NaN, an infinity) is null.
Python's json writes NaN, which jq, JavaScript and strict parsers refuse."""

from __future__ import annotations

import json
import math


def finite(obj):
    """`obj` with every non-finite float replaced by None (dicts, lists, tuples walked)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj, **kwargs) -> str:
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
