"""Matching the regular expressions of an uploaded adapter_config.json against every module name
of the base model, in bounded time whatever they say.

Python's re backtracks and cannot be interrupted, so one regex crafted to backtrack for minutes
would stall the whole server: each is costed from its parsed form, and only one sure to stay
cheap is compiled with re. The others (three `.*`, a repeated group: `.*layers.*self_attn.*(q|v)_proj`,
`(?:\\w+\\.)*q_proj`) run on PositionSets, which carries the set of positions a regex can reach
through its parsed form, so its time grows with the name's length, not exponentially, and counts
its steps against a budget shared by the config.
"""

from __future__ import annotations

import math
import re
import re._parser  # NOTE: to inspect uploaded regexes before they are ever matched
import reprlib
from collections.abc import Callable, Iterable
from re import _constants as _parser_constants
from typing import Protocol

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
# Steps (a position carried through one node or round of a regex) that PositionSets may take over
# all the matching of one config, 0.1-0.5 us each (so at most ~1 s): `.*layers.*self_attn.*(q|v)_proj`
# takes 150-230 steps on a module name of a 126-layer model, 0.13-0.2 M for all its 882 modules.
_MAX_POSITION_STEPS = 2_000_000


class ModuleRegex(Protocol):
    """An uploaded regex as PEFT applies it to a module name (after its template)."""

    pattern: str

    def matches(self, name: str) -> bool:
        """Whether the regex matches all of `name`."""


class Regexes:
    """Compiles the regexes of one config while matching them all stays cheap."""

    def __init__(self) -> None:
        self.num_chars = 0
        self.num_ways = 0  # each backtracking regex's ways to split a module name, plus _REGEX_BASE_WAYS
        self._steps = _StepBudget(_MAX_POSITION_STEPS)

    def compile(self, value: str, field: str, template: str) -> re.Pattern:
        """`template` around the uploaded regex `value`, compiled with re as PEFT compiles it (for
        layers_pattern, whose match is read); AdapterValidationError if it could backtrack long."""
        self._count(value, field, _num_match_ways(value, field))
        return self._compile(value, field, template)

    def compile_module_regex(self, value: str, field: str, template: str) -> ModuleRegex:
        """`template` around the uploaded regex `value`, to full-match module names: with re when
        that is sure to be cheap, else on PositionSets."""
        try:
            num_ways = _num_match_ways(value, field)
        except _CostlyRegex as costly:
            pattern = self._compile(value, field, template)  # invalid ones fail as in PEFT
            self._count(value, field, 0)
            try:
                return PositionSets(pattern.pattern, self._steps, f"{field} {value!r}")
            except _UnsupportedConstruct as construct:
                raise AdapterValidationError(
                    f"{costly}; its {construct} also keeps it off the matcher that runs such regexes "
                    "in bounded time") from None
        self._count(value, field, num_ways)
        return _Backtracking(self._compile(value, field, template))

    def _count(self, value: str, field: str, num_ways: float) -> None:
        self.num_chars += len(value)
        self.num_ways += num_ways + _REGEX_BASE_WAYS
        if self.num_chars > _MAX_CONFIG_REGEX_CHARS or self.num_ways > _MAX_CONFIG_WAYS:
            raise AdapterValidationError(
                f"the adapter's config has too many regular expressions to match against every module "
                f"(stopped at {field} {reprlib.repr(value)}): target_modules, exclude_modules, "
                f"layers_pattern and the rank_pattern and alpha_pattern keys may hold up to "
                f"{_MAX_CONFIG_WAYS // (1 + _REGEX_BASE_WAYS)} module names in "
                f"{_MAX_CONFIG_REGEX_CHARS} characters, and fewer patterns with .*, ? or "
                "alternatives; give keys that share a value one pattern")

    @staticmethod
    def _compile(value: str, field: str, template: str) -> re.Pattern:
        pattern = template.format(value)
        try:
            return re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as e:
            wrapped = f" once PEFT wraps it as {pattern!r}" if pattern != value else ""
            raise AdapterValidationError(
                f"{field} {value!r} is not a valid regular expression{wrapped} ({e})") from e


class _CostlyRegex(AdapterValidationError):
    """A valid regex that re could take too long to match (the message says why)."""


class _Backtracking:
    """A ModuleRegex on re."""

    def __init__(self, compiled: re.Pattern):
        self.pattern = compiled.pattern
        self._compiled = compiled

    def matches(self, name: str) -> bool:
        return self._compiled.fullmatch(name) is not None


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
        raise _CostlyRegex(
            f"{field} {value!r} repeats a group that itself repeats or branches, which can take "
            "exponential time to match; simplify it or list the module names instead")
    num_ways *= math.comb(_MAX_NAME_CHARS + num_unbounded, num_unbounded)
    if num_ways > _MAX_MATCH_WAYS:
        raise _CostlyRegex(
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


class _UnsupportedConstruct(Exception):
    """A regex construct PositionSets does not run (its text names it)."""


class _StepBudget:
    """The steps PositionSets may still take for one config."""

    def __init__(self, steps: int):
        self.left = steps


_C = _parser_constants
_CHARACTER_OPS = (_C.LITERAL, _C.NOT_LITERAL, _C.ANY, _C.IN)
_CATEGORIES: dict[object, Callable[[str], bool]] = {
    _C.CATEGORY_DIGIT: str.isdecimal,
    _C.CATEGORY_NOT_DIGIT: lambda c: not c.isdecimal(),
    _C.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
    _C.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
    _C.CATEGORY_SPACE: str.isspace,
    _C.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
}
_UNSUPPORTED = {_C.POSSESSIVE_REPEAT: "possessive repeat", _C.ATOMIC_GROUP: "atomic group",
                _C.GROUPREF: "backreference", _C.GROUPREF_EXISTS: "conditional group"}
# Whether a full match of a name can end at one position, as each anchor asks.
_ANCHORS: dict[object, Callable[[str, int], bool]] = {
    _C.AT_BEGINNING: lambda s, p: p == 0,
    _C.AT_BEGINNING_STRING: lambda s, p: p == 0,
    _C.AT_END: lambda s, p: p == len(s) or (p == len(s) - 1 and s[p] == "\n"),
    _C.AT_END_STRING: lambda s, p: p == len(s),
    _C.AT_BOUNDARY: lambda s, p: _is_word_at(s, p - 1) != _is_word_at(s, p),
    # NOTE: re's \B never matches an empty string
    _C.AT_NON_BOUNDARY: lambda s, p: bool(s) and _is_word_at(s, p - 1) == _is_word_at(s, p),
}


def _is_word_at(s: str, p: int) -> bool:
    return 0 <= p < len(s) and (s[p].isalnum() or s[p] == "_")


class PositionSets:
    """A ModuleRegex run as the set of positions of the name that each part of the parsed regex
    can reach: a repeat adds what one more round reaches until nothing new comes, so a name of n
    characters takes polynomial time in n whatever the regex, where re may backtrack for hours.

    Greedy and lazy repeats reach the same positions, so a full match is the same as re's.
    Possessive repeats, atomic groups, backreferences and conditionals change what matches and are
    not run (_UnsupportedConstruct). Every step counts against the config's budget: past it the
    regex is refused as too slow to match.
    """

    def __init__(self, pattern: str, budget: _StepBudget, what: str):
        self.pattern = pattern
        parsed = re._parser.parse(pattern)
        _check_supported(parsed)
        self._items = list(parsed)
        self._ignore_case = bool(parsed.state.flags & re.IGNORECASE)
        self._budget = budget
        self._what = what

    def matches(self, name: str) -> bool:
        return len(name) in self._sequence(self._items, {0}, name, self._ignore_case)

    def _spend(self, steps: int) -> None:
        self._budget.left -= steps
        if self._budget.left < 0:
            raise AdapterValidationError(
                f"{self._what} takes too long to match against the model's module names (with the "
                f"config's other regexes, over {_MAX_POSITION_STEPS} steps); simplify it or list "
                "the module names instead")

    def _sequence(self, items: Iterable, positions: set[int], s: str, ignore_case: bool) -> set[int]:
        for op, arg in items:
            if not positions:
                break
            positions = self._item(op, arg, positions, s, ignore_case)
        return positions

    def _item(self, op, arg, positions: set[int], s: str, ignore_case: bool) -> set[int]:
        self._spend(1 + len(positions))
        if op in _CHARACTER_OPS:
            test = _character_test(op, arg, ignore_case)
            return {p + 1 for p in positions if p < len(s) and test(s[p])}
        if op is _C.AT:
            anchor = _ANCHORS[arg]
            return {p for p in positions if anchor(s, p)}
        if op is _C.BRANCH:
            self._spend(len(arg[1]) * len(positions))  # the union of what each alternative reached
            return set().union(*(self._sequence(alt, positions, s, ignore_case) for alt in arg[1]))
        if op is _C.SUBPATTERN:
            _, add_flags, del_flags, sub = arg
            ignore_case = (ignore_case or bool(add_flags & re.IGNORECASE)) and not del_flags & re.IGNORECASE
            return self._sequence(sub, positions, s, ignore_case)
        if op in (_C.MAX_REPEAT, _C.MIN_REPEAT):
            return self._repeat(*arg, positions, s, ignore_case)
        if op in (_C.ASSERT, _C.ASSERT_NOT):
            direction, sub = arg
            wanted = op is _C.ASSERT
            width = sub.getwidth()[0]  # a lookbehind's, which re requires to be fixed
            start = 0 if direction == 1 else width
            return {p for p in positions
                    if self._looks(sub, p - start, p if direction != 1 else None, s, ignore_case) == wanted}
        raise _UnsupportedConstruct(str(op))  # NOTE: _check_supported ruled these out

    def _looks(self, sub, start: int, end: int | None, s: str, ignore_case: bool) -> bool:
        """Whether `sub` matches from `start` (a lookahead: to anywhere; a lookbehind: to `end`)."""
        if start < 0:
            return False
        reached = self._sequence(sub, {start}, s, ignore_case)
        return bool(reached) if end is None else end in reached

    def _repeat(self, low: int, high: int, sub, positions: set[int], s: str, ignore_case: bool) -> set[int]:
        if high == _C.MAXREPEAT and low <= 1 and len(sub) == 1 and sub[0][0] in _CHARACTER_OPS:
            return self._run(_character_test(*sub[0], ignore_case), low, positions, s)
        reached = set(positions) if low == 0 else set()
        current, rounds = positions, 0
        while current and rounds < high:
            self._spend(1 + len(current))
            current = self._sequence(sub, current, s, ignore_case)
            rounds += 1
            if rounds >= low:
                # NOTE: positions reached before with as many rounds left reach all these can.
                if rounds > low and current <= reached:
                    break
                reached |= current
        return reached

    def _run(self, test: Callable[[str], bool], low: int, positions: set[int], s: str) -> set[int]:
        """`c*` or `c+` of one character test: one pass along the name."""
        first = min(positions)
        self._spend(len(s) + 1 - first)
        reached, in_run = set(), False  # in_run: some position before p reaches p through c's
        for p in range(first, len(s) + 1):
            if in_run or (low == 0 and p in positions):
                reached.add(p)
            in_run = p < len(s) and (in_run or p in positions) and test(s[p])
        return reached


def _check_supported(items) -> None:
    for op, arg in items:
        if op in _UNSUPPORTED:
            raise _UnsupportedConstruct(_UNSUPPORTED[op])
        if op is _C.IN:
            for class_op, _ in arg:
                if class_op not in (_C.NEGATE, _C.LITERAL, _C.RANGE, _C.CATEGORY):
                    raise _UnsupportedConstruct(f"character class item {class_op}")
        if op is _C.AT and arg not in _ANCHORS:
            raise _UnsupportedConstruct(f"anchor {arg}")
        for sub in _subpatterns(arg):
            _check_supported(sub)


def _character_test(op, arg, ignore_case: bool) -> Callable[[str], bool]:
    """Whether one character of the name matches a character item of the parsed regex."""
    if op is _C.ANY:
        return lambda c: c != "\n"  # NOTE: module names never hold one; DOTALL is not read
    if op in (_C.LITERAL, _C.NOT_LITERAL):
        literal, equal = chr(arg), op is _C.LITERAL
        if ignore_case:
            folded = literal.lower()
            return lambda c: (c.lower() == folded) == equal
        return lambda c: (c == literal) == equal
    negate = bool(arg) and arg[0][0] is _C.NEGATE
    literals = {chr(a) for o, a in arg if o is _C.LITERAL}
    ranges = [a for o, a in arg if o is _C.RANGE]
    categories = [_CATEGORIES[a] for o, a in arg if o is _C.CATEGORY]

    def in_class(c: str) -> bool:
        return c in literals or any(lo <= ord(c) <= hi for lo, hi in ranges) or any(t(c) for t in categories)

    if ignore_case:
        return lambda c: (in_class(c) or in_class(c.lower()) or in_class(c.upper())) != negate
    return lambda c: in_class(c) != negate
