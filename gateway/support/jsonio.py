"""JSON bytes in and out, fast: orjson (faster than `json` both ways, by most when writing:
docs/BENCHMARKS.md, "The figures behind smaller choices"), and the standard library only where
orjson would change a value: integers beyond 64 bits, which it reads as floats and cannot write.
`orjson.Fragment` puts JSON already written into a document: a request's history is written
once for both engines.

`loads` is strict, as a client's body must be: UTF-8 only, no NaN or Infinity, finite numbers,
no lone UTF-16 surrogate escape (no engine can tokenize one, UTF-8 cannot encode it): orjson
refuses all of these by itself. `loads_engine` reads what an engine sends as Python's json
does (NaN and Infinity kept as written, lone surrogates, integers beyond 64 bits), and `dumps`
writes all of it back.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_HUGE = 2.0**63  # orjson reads integer literals it cannot hold as floats at least this big
# 2**63 has 19 digits: a run of 19 digits is a number orjson may not hold. Found by mapping every
# digit to "0" and looking for 19 of them (bytes.translate and a substring search, both in C),
# not with the regex \d{19}, which tries a match at every digit of every event.
_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
_LONG_RUN = b"0" * 19
_CONTAINERS = frozenset((dict, list))


class TooDeep(ValueError):
    """The value nests containers deeper than the caller allows."""


def loads(raw: bytes, max_depth: int = 64) -> Any:
    """The JSON value of `raw`; ValueError (or RecursionError) if it is not strict JSON,
    TooDeep if it nests more than `max_depth` containers."""
    value = orjson.loads(raw)  # strict in every way above by itself
    if isinstance(value, (dict, list)) and _walk(value, max_depth):
        # A float that may have been an integer beyond 64 bits: `json` keeps it exact.
        value = json.loads(raw)
    return value


def loads_engine(raw: bytes, exact: bool = True) -> Any:
    """An engine's JSON (a reply, one streamed event) as Python's json reads it: orjson where
    the two agree, json for NaN and Infinity (kept as they were written), lone surrogates and,
    if `exact`, numbers too long for orjson to hold exactly (a value only read, never written
    back, needs no such scan: it runs on every streamed event). ValueError if it is not
    JSON."""
    if not (exact and _LONG_RUN in raw.translate(_DIGITS_AS_ZERO)):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw, parse_constant=_Constant.of)


class _Constant(float):
    """NaN, Infinity or -Infinity as an engine wrote it: `dumps` writes it back as it came
    (orjson would write null)."""

    __slots__ = ("literal",)
    literal: bytes

    @classmethod
    def of(cls, literal: str) -> _Constant:
        constant = cls(literal.lower().replace("infinity", "inf"))
        constant.literal = literal.encode()
        return constant


def _walk(value: dict | list, max_depth: int) -> bool:
    """Check the depth, one level at a time, the types of a level's children in C (a history
    of plain messages costs a call or two per message); True if a float of 2**63 or more is in
    it (an integer orjson could not hold reads as one)."""
    huge = False
    level: list = [value]
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise TooDeep(f"nests JSON deeper than {max_depth} levels")
        nested: list = []
        for container in level:
            children = container.values() if type(container) is dict else container
            kinds = set(map(type, children))
            if float in kinds and not huge:
                huge = any(type(c) is float and not -_HUGE < c < _HUGE for c in children)
            if kinds <= _CONTAINERS:
                nested.extend(children)  # a history: a list of messages
            elif dict in kinds or list in kinds:
                nested.extend(c for c in children if type(c) is dict or type(c) is list)
        level = nested
    return huge


class Written:
    """JSON already written, to be put as it is into any number of documents by `dumps`."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON of `value` (which may hold `Written` parts)."""
    try:
        return orjson.dumps(value, default=_as_fragment)
    except TypeError:  # an integer beyond 64 bits, a lone surrogate (json read them)
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_as_value)
        try:
            return text.encode()
        except UnicodeEncodeError:  # a lone surrogate: escaped, as json writes it by default
            return json.dumps(value, separators=(",", ":"), default=_as_value).encode()


def fragment(value: Any) -> Any:
    """`value` written once, for `dumps` to put into any number of documents (or `value`
    itself if orjson cannot write it)."""
    try:
        return Written(orjson.dumps(value))
    except TypeError:
        return value


def _as_fragment(value: Any) -> Any:
    if isinstance(value, Written):
        return orjson.Fragment(value.data)
    if isinstance(value, _Constant):
        return orjson.Fragment(value.literal)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _as_value(value: Any) -> Any:
    if isinstance(value, Written):
        return json.loads(value.data)
    raise TypeError(f"{type(value).__name__} is not JSON")
