"""Compiling the regular expressions of an uploaded adapter_config.json only when matching them
against every module name of the base model is sure to stay cheap.

Python's re backtracks and cannot be interrupted, so one regex crafted to backtrack for minutes
would stall the whole server: each is costed from its parsed form before it is compiled.
"""

from __future__ import annotations

import math
import re
import re._parser  # NOTE: to inspect uploaded regexes before they are ever matched
import reprlib
from re import _constants as _parser_constants

from adapters.errors import AdapterValidationError

_MAX_REGEX_CHARS = 1000
# NOTE: Python's re backtracks and holds the GIL, and every uploaded regex is matched against each
# module name of the base model, so a regex is only compiled once the number of ways it can split
# a name is bounded: C(n + k, k) * w for k unbounded repeats (*, +, {m,}) and w combinations of the
# other choices (optional parts, bounded repeats, alternatives that can begin alike), on names of
# n <= 64 characters (this server matches model.layers.<i>.<parent>.<proj>, under 40). Measured
# with CPython 3.11 on a 33- and a 96-character name, the slowest accepted regexes found ('.*' * 2
# + '[YZ]', '.?' * 12 + 'Z', '.*(?:|.|..|...)' with 63 alternatives) take at most 0.06 and 0.2 ms
# a match as written, 0.33 and 1 ms inside get_pattern_key's wrapping, which retries them after
# each '.'; '.*' * 3 + '[YZ]' (47905 ways: rejected) takes 0.07 and 2.3 ms, each further '.*' ~20x.
_MAX_NAME_CHARS = 64
_MAX_MATCH_WAYS = 4096
# A config may hold thousands of regexes (rank_pattern and alpha_pattern keys), each tried up to
# twice a module: the sum is bounded too, each regex counting its ways plus what one that fails at
# once costs (0.25 us, as much as 8 ways), and compiling takes ~1.5 us a character. Measured on
# 126 layers (882 modules): rank and alpha keys for every module (1764 names, 58 KiB) match in
# 0.23 s, the worst accepted configs (3 keys of 4096 ways, or 1820 names no module matches) in ~1 s.
_REGEX_BASE_WAYS = 8
_MAX_CONFIG_WAYS = 4 * _MAX_MATCH_WAYS
_MAX_CONFIG_REGEX_CHARS = 1 << 17
_REPEATS = (_parser_constants.MAX_REPEAT, _parser_constants.MIN_REPEAT,
            _parser_constants.POSSESSIVE_REPEAT)


class Regexes:
    """Compiles the regexes of one config while matching them all stays cheap."""

    def __init__(self) -> None:
        self.num_chars = 0
        self.num_ways = 0  # each regex's ways to split a module name, plus _REGEX_BASE_WAYS

    def compile(self, value: str, field: str, template: str) -> re.Pattern:
        """`template` around the uploaded regex `value`, compiled as PEFT compiles it."""
        self.num_chars += len(value)
        self.num_ways += _num_match_ways(value, field) + _REGEX_BASE_WAYS
        if self.num_chars > _MAX_CONFIG_REGEX_CHARS or self.num_ways > _MAX_CONFIG_WAYS:
            raise AdapterValidationError(
                f"the adapter's config has too many regular expressions to match against every module "
                f"(stopped at {field} {reprlib.repr(value)}): target_modules, exclude_modules, "
                f"layers_pattern and the rank_pattern and alpha_pattern keys may hold up to "
                f"{_MAX_CONFIG_WAYS // (1 + _REGEX_BASE_WAYS)} module names in "
                f"{_MAX_CONFIG_REGEX_CHARS} characters, and fewer patterns with .*, ? or "
                "alternatives; give keys that share a value one pattern")
        pattern = template.format(value)
        try:
            return re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as e:
            wrapped = f" once PEFT wraps it as {pattern!r}" if pattern != value else ""
            raise AdapterValidationError(
                f"{field} {value!r} is not a valid regular expression{wrapped} ({e})") from e


def _num_match_ways(value: str, field: str) -> float:
    """About how many ways backtracking may try to match `value` to a module name; at most
    _MAX_MATCH_WAYS, or AdapterValidationError."""
    if len(value) > _MAX_REGEX_CHARS:
        raise AdapterValidationError(
            f"{field} is a {len(value)}-character regular expression; at most {_MAX_REGEX_CHARS} "
            "are accepted: list the module names instead")
    try:
        num_unbounded, num_ways = _choices(re._parser.parse(value))
    except (re.error, OverflowError, RecursionError) as e:
        raise AdapterValidationError(f"{field} {value!r} is not a valid regular expression ({e})") from e
    if math.isinf(num_ways):
        raise AdapterValidationError(
            f"{field} {value!r} repeats a group that itself repeats or branches, which can take "
            "exponential time to match; simplify it or list the module names instead")
    num_ways *= math.comb(_MAX_NAME_CHARS + num_unbounded, num_unbounded)
    if num_ways > _MAX_MATCH_WAYS:
        raise AdapterValidationError(
            f"{field} {value!r} can split a module name in too many ways for the regex engine to "
            f"try ({num_unbounded} unbounded repeats such as .* or \\d+, times the optional parts, "
            "bounded repeats and alternatives): at most 2 unbounded repeats, with few other choices "
            "beside them, are accepted; simplify it or list the module names instead")
    return num_ways


def _choices(pattern) -> tuple[int, float]:
    """(unbounded repeats, combinations of the other choices) of a parsed regex, read in sequence;
    the combinations are inf for a repeat of something that can itself match in several ways."""
    parts = [_item_choices(op, arg) for op, arg in pattern]
    return sum(k for k, _ in parts), math.prod(ways for _, ways in parts)


def _item_choices(op, arg) -> tuple[int, float]:
    if op in _REPEATS:
        return _repeat_choices(*arg)
    if op == _parser_constants.BRANCH:
        return _branch_choices(arg[1])
    # Groups, lookarounds, conditionals: their contents, counted as if in sequence.
    return _choices([item for sub in _subpatterns(arg) for item in sub])


def _repeat_choices(low: int, high: int, sub) -> tuple[int, float]:
    sub_unbounded, sub_ways = _choices(sub)
    if high > 1 and (sub_unbounded or sub_ways > 1):
        return 0, math.inf  # backtracking may try every way for every repetition: exponential
    if high == _parser_constants.MAXREPEAT:
        return 1, 1
    if high > 1:
        return 0, min(high, _MAX_NAME_CHARS) - min(low, _MAX_NAME_CHARS) + 1
    return sub_unbounded, sub_ways + (1 if low < high else 0)  # optional (?), or exactly once


def _branch_choices(alternatives) -> tuple[int, float]:
    # NOTE: an alternative that begins with a literal other than the next character fails at once,
    # so only alternatives that can begin with the same character add up.
    ways_by_first: dict[str | None, float] = {}
    num_unbounded = 0
    for alternative in alternatives:
        sub_unbounded, sub_ways = _choices(alternative)
        num_unbounded = max(num_unbounded, sub_unbounded)
        op, arg = alternative[0] if len(alternative) else (None, None)
        first = chr(arg).casefold() if op == _parser_constants.LITERAL else None
        ways_by_first[first] = ways_by_first.get(first, 0) + sub_ways
    any_first = ways_by_first.pop(None, 0)
    return num_unbounded, any_first + max(ways_by_first.values(), default=0)


def _subpatterns(arg) -> list:
    """The parsed sub-regexes inside an opcode's argument (groups, lookarounds, conditionals)."""
    if isinstance(arg, re._parser.SubPattern):
        return [arg]
    if isinstance(arg, (tuple, list)):
        return [sub for item in arg for sub in _subpatterns(item)]
    return []
