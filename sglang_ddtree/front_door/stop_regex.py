"""The stop_regex bounds: how long a pattern can match (SGLang's measure of it, and this module's)
and in how many ways at one place, which bound the scheduler's search of a request's output
after every round."""

from __future__ import annotations

import re
from collections.abc import Callable
from re import _constants as re_constants  # the parsed form's opcodes (SGLang reads it too)
from re import _parser as re_parser

from sglang_ddtree.front_door.values import show

MAX_STOP_REGEX_MATCH = 128  # characters one stop_regex pattern can match (SGLang's measure)
MAX_STOP_REGEX_WORK = 512  # a request's patterns' ways to match at one place x that length, summed


def check_regex_cost(patterns: list[str], measure: Callable[[str], int] | None) -> None:
    """After every round the scheduler decodes as many of the output's last tokens as the
    longest match of a request's patterns (SGLang's measure of it, `measure`) and searches each
    pattern over them. A pattern it cannot bound (`+`, `*`, `{n,}`, and in SGLang's measure also
    lookarounds, backreferences, `[^x]`, atomic groups, possessive repeats) makes that the whole
    output, every round; and a search backtracks through every way a pattern can match at each
    place of that text (`(a+)+c` took 0.8 s on 24 characters, and SGLang's watchdog ends a server
    whose round stalls). So each pattern's longest match is at most MAX_STOP_REGEX_MATCH
    characters, and its ways to match one place times that length, summed over the request's
    patterns, at most MAX_STOP_REGEX_WORK: a few milliseconds a round, even on a tail of the
    vocabulary's longest tokens."""
    total = 0
    for pattern in patterns:
        longest, ways = _regex_shape(re_parser.parse(pattern), {})
        if measure is not None:
            longest = max(longest, measure(pattern))
        if longest > MAX_STOP_REGEX_MATCH:
            span = "without bound" if longest >= _UNBOUNDED else f"{longest} characters"
            raise ValueError(
                f"stop_regex {show(pattern)} can match {span}: DDTREE's limit is "
                f"{MAX_STOP_REGEX_MATCH} characters (the scheduler decodes that much of the "
                "output after every round to search it, all of it for a pattern it cannot bound: "
                "`+`, `*`, lookarounds, backreferences, [^x]); bound its repeats, e.g. {0,16} for *."
            )
        total += ways * longest
        if total > MAX_STOP_REGEX_WORK:
            shown = f"{ways} ways" if ways < _MANY else "too many ways"
            raise ValueError(
                f"stop_regex {show(pattern)} can match one place in {shown}, each up to "
                f"{longest} characters: with the request's other patterns, {min(total, _MANY)} "
                f"against DDTREE's limit of {MAX_STOP_REGEX_WORK} (the search backtracks through "
                "them at every place of the text after every round); use fewer or shorter "
                "optional and repeated parts, and no repeat inside a repeat."
            )


_UNBOUNDED = 1 << 30  # a match length without bound (SGLang's MAX_LEN)
_MANY = 1 << 20  # ways counted no further
_REPEATS = (re_constants.MAX_REPEAT, re_constants.MIN_REPEAT, re_constants.POSSESSIVE_REPEAT)


def _regex_shape(items, groups: dict) -> tuple[int, int]:
    """(the longest match, the ways to match at one place) of a parsed pattern: lengths add and
    ways multiply along a sequence, a branch takes its longest and the sum of its ways, a repeat
    of a part with w ways k times in [low, high] has sum_k w^k. Both saturate."""
    longest, ways = 0, 1
    for op, value in items:
        if op in _REPEATS:
            low, high, body = value
            part, part_ways = _regex_shape(body, groups)
            longest += _UNBOUNDED if high == re_constants.MAXREPEAT else high * part
            ways *= _MANY if high == re_constants.MAXREPEAT else _repeat_ways(low, high, part_ways)
        elif op is re_constants.BRANCH:
            shapes = [_regex_shape(branch, groups) for branch in value[1]]
            longest += max(s[0] for s in shapes)
            ways *= sum(s[1] for s in shapes)
        elif op is re_constants.SUBPATTERN:
            part, part_ways = _regex_shape(value[3], groups)
            if value[0] is not None:
                groups[value[0]] = part
            longest, ways = longest + part, ways * part_ways
        elif op in (re_constants.ASSERT, re_constants.ASSERT_NOT, re_constants.ATOMIC_GROUP):
            body = value if op is re_constants.ATOMIC_GROUP else value[1]
            part, part_ways = _regex_shape(body, groups)
            longest, ways = longest + part, ways * part_ways
        elif op is re_constants.GROUPREF:
            longest += groups.get(value, _UNBOUNDED)
        elif op is re_constants.GROUPREF_EXISTS:
            shapes = [_regex_shape(b, groups) for b in value[1:] if b is not None]
            longest += max(s[0] for s in shapes)
            ways *= sum(s[1] for s in shapes) + (value[2] is None)
        elif op is not re_constants.AT:  # one character (a literal, a class, any); AT: none
            longest += 1
        longest, ways = min(longest, _UNBOUNDED), min(ways, _MANY)
    return longest, ways


def _repeat_ways(low: int, high: int, part: int) -> int:
    """sum of part^k for k in [low, high], saturating at _MANY, in a few steps whatever the
    counts (a pattern of 256 bytes can hold repeats of 2^32)."""
    if part <= 1:
        return min(high - low + 1, _MANY)
    if high * (part.bit_length() - 1) >= _MANY.bit_length():  # part^high alone is past it
        return _MANY
    return min(sum(part**k for k in range(low, high + 1)), _MANY)


def compiles(pattern: str) -> None:
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:  # a{4294967295}: OverflowError
        raise ValueError(
            f"stop_regex {show(pattern)} is not a regular expression: {exc}."
        ) from None
