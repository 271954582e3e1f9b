"""The shapes of a request's values that the front door's checks share: each raises ValueError
naming the field, the value and the limit."""

from __future__ import annotations

import math
import re

INT64 = (-(1 << 63), (1 << 63) - 1)


def number(name: str, value) -> float | None:
    """value as a finite real number (None stays None: SGLang's default), or a ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {show(value)}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return value


def whole(name: str, value) -> int:
    """value as an integer, or a ValueError (an integral float where the scheduler reads the
    field is made an integer first: request_limits._integers)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {show(value)}.")
    return value


def token_id(name: str, value) -> int:
    """A token id: an integer, or a string of one (JSON object keys are strings)."""
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return whole(name, value)


def within(name: str, value, low, high, what: str) -> None:
    if not low <= value <= high:
        shown = f"{value:.6g}" if isinstance(value, int) and abs(value) >= 10**15 else value
        raise ValueError(f"{name}={shown} is outside DDTREE's limit [{low}, {high}] {what}.")


def show(value, width: int = 48) -> str:
    """A short repr for a message (a 1 MB string is named by its start and length)."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width]}... ({len(text)} characters)"


def string(name: str, value, most: int) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {show(value)}.")
    within(f"len({name})", len(value), 0, most, "characters")


def scalar(name: str, value) -> None:
    """A JSON scalar: null, true or false, a string, an integer within int64, a finite number."""
    if value is None or isinstance(value, bool | str):
        return
    if isinstance(value, int):
        within(name, value, *INT64, "(an integer within int64)")
    elif isinstance(value, float):
        number(name, value)
    else:
        raise ValueError(
            f"{name} must hold JSON scalars (no deeper lists or objects), got {show(value)}."
        )
