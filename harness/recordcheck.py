"""Checks of a parsed ``requests.jsonl`` record against ``RequestRecord``'s fields and types.

``records.read_requests`` runs it on every line, so ``run --resume``, ``report``, ``compare`` and
``gate`` all refuse a hand-edited or foreign record (a missing field, ``"repeat": "one"``) with
one line naming the file, the line and the field, instead of a TypeError deep in the tables.
"""

from __future__ import annotations

import functools
import math
from typing import Any


@functools.cache
def _request_fields() -> tuple[dict[str, str], frozenset[str]]:
    import dataclasses

    from harness.records import RequestRecord

    types = {f.name: str(f.type) for f in dataclasses.fields(RequestRecord) if f.init}
    required = frozenset(f.name for f in dataclasses.fields(RequestRecord)
                         if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return types, required


def request_record_problem(obj: Any) -> str | None:
    """What is wrong with one parsed request record, or None."""
    if not isinstance(obj, dict):
        return f"expected a request record (a JSON object), got {_json_type(obj)}"
    types, required = _request_fields()
    missing = sorted(required - obj.keys())
    if missing:
        return f"record missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"
    for name, value in obj.items():
        declared = types.get(name)
        if declared is not None and not _has_type(value, declared):
            return f"{name}: expected {declared.replace('EventCounts', 'an object of counts')}, got {value!r:.60}"
    return _range_problem(obj)


def _range_problem(obj: dict[str, Any]) -> str | None:
    """Every number of a record is finite and not negative: JSON readers take ``NaN`` and
    ``Infinity``, and a NaN ``oracle_wer`` read as "not measured", a negative WER as better than
    perfect (issue 24, case 16). Types are checked already."""
    for name in sorted(obj):
        value = obj[name]
        if name == "events":
            for key in sorted(value):
                if value[key] < 0:
                    return f"events.{key}: must be a count >= 0, got {value[key]!r}"
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isnan(value) or math.isinf(value) or value < 0:
                kind = "a count" if isinstance(value, int) else "a finite number"
                return f"{name}: must be {kind} >= 0, got {value!r}"
    return None


def _has_type(value: Any, declared: str) -> bool:
    for part in (p.strip() for p in declared.split("|")):
        if part == "None" and value is None:
            return True
        if part == "str" and isinstance(value, str):
            return True
        if part == "bool" and isinstance(value, bool):
            return True
        if part == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if part == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if part.startswith("list[") and isinstance(value, list):
            inner = part[5:-1]
            if inner == "int" and set(map(type, value)) <= {int}:  # codec_tokens: thousands of ints, one C pass
                return True
            return all(_has_type(v, inner) for v in value)
        if part == "EventCounts" and isinstance(value, dict):
            return all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in value.items())
        if part not in ("None", "str", "bool", "int", "float", "EventCounts") and not part.startswith("list["):
            return True  # a type this check does not know: not its business
    return False


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)
