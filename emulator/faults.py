"""Fault injection: the modes an engine can be switched into, from --fault or POST /faults."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

MODES = (
    "none",
    "down",
    "error500",
    "slow",
    "hang",
    "die_after",
    "error_after",
    "stall_after",
    "no_params",
)


@dataclass(frozen=True)
class Fault:
    """One fault setting; options that do not belong to the mode are ignored."""

    mode: str = "none"
    delay_s: float = 0.0  # slow: extra wait before the first byte
    tokens: int = 0  # die_after, error_after, stall_after: content tokens sent before it
    max_s: float = 3600.0  # hang, stall_after: bound, so a forgotten fault cannot pin a greenlet
    count: int | None = None  # apply to the next `count` completion requests, then revert to none

    @classmethod
    def from_dict(cls, data: object) -> Fault:
        """Validate a POST /faults body (or a parsed --fault spec); ValueError names the bad key."""
        if not isinstance(data, dict):
            raise ValueError('fault must be a JSON object like {"mode": "down"}')
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown fault option(s) {unknown}; known: {sorted(known)}")
        if data.get("mode", "none") not in MODES:
            raise ValueError(f"fault mode must be one of {list(MODES)}, got {data.get('mode')!r}")
        values: dict[str, Any] = {}  # each checked against its field below
        for key, value in data.items():
            if key == "mode":
                values[key] = value
                continue
            if key == "count" and value is None:
                values[key] = None
                continue
            want = float if key in ("delay_s", "max_s") else int
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(f"fault option {key} must be a number, got {value!r}")
            try:
                number = want(value)
            except ValueError as exc:
                raise ValueError(f"fault option {key} must be a number, got {value!r}") from exc
            if number < 0:
                raise ValueError(f"fault option {key} must be >= 0, got {value!r}")
            values[key] = number
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_fault_spec(spec: str) -> Fault:
    """Parse the CLI form MODE[,key=value...], e.g. ``slow,delay_s=2`` or ``die_after,tokens=3``."""
    mode, *options = [part.strip() for part in spec.split(",") if part.strip()] or ["none"]
    data: dict[str, object] = {"mode": mode}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"--fault option {option!r} is not key=value")
        data[key.strip()] = value.strip()
    return Fault.from_dict(data)


class FaultState:
    """The engine's current fault; `take()` hands each completion request the fault it must
    suffer."""

    def __init__(self, fault: Fault | None = None) -> None:
        self.current = fault or Fault()

    def set(self, fault: Fault) -> None:
        self.current = fault

    def take(self) -> Fault:
        fault = self.current
        if fault.count is not None:
            if fault.count <= 0:
                self.current = Fault()
                return self.current
            left = fault.count - 1
            self.current = Fault(**{**fault.to_dict(), "count": left}) if left else Fault()
        return fault

    @property
    def down(self) -> bool:
        return self.current.mode == "down"
