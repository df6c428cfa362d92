"""Checks of settings given by a user (a tactic's fields, automap's arguments), made
when they are given so that a wrong one fails before any work, with the thing, the
problem and the fix in the message."""

from __future__ import annotations

import math
import numbers
import re
import sys
import warnings

from partir import PartitioningError
from partir._ir import _keys as joined_keys


def a(noun: str) -> str:
    """'a str', 'an int'."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def number(where: str, value, *, integer: bool = False, optional: bool = False, sign: str = "positive",
           example: str = "", error: type[Exception] = PartitioningError, given: str | None = None):
    """`value` checked to be a real number (an int when `integer`), finite, and of `sign`
    ("positive": > 0, "non-negative": >= 0, "any"); `None` passes when `optional`.
    Booleans and strings are not numbers, nor is a number too large for a float
    (`10**400`) where a float is wanted. Returns it as a float (an int when `integer`).
    `where` names the setting, e.g. "AutomaticPartition budget_s"; `example` shows a
    good value; `given` is how the user wrote the value, where it was text (a command
    line's '1e400'), shown instead of its repr."""
    if value is None and optional:
        return None
    head = f"{where} {given!r}" if given is not None else f"{where}={_short(value)}"
    want = ("an integer" if integer else "a finite number") if sign == "any" else \
        f"a {sign} {'integer' if integer else 'finite number'}"
    fix = f"give {want}{' or None' if optional else ''}" + (f", e.g. {example}" if example else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        raise error(f"{head} is {a(type(value).__name__)}, not {'an integer' if integer else 'a number'}: {fix}")
    if not integer:  # an int of any size is an integer; a float must hold the value
        try:
            value = float(value)
        except OverflowError:
            raise error(f"{head} is too large for a float (at most {sys.float_info.max:.3g}): {fix}") from None
        if not math.isfinite(value):
            raise error(f"{head} is not finite: {fix}")
    if (sign == "positive" and value <= 0) or (sign == "non-negative" and value < 0):
        raise error(f"{head} is out of range: {fix}")
    return int(value) if integer else value


#: Longest repr of a value quoted in a message; longer ones (an int of 400 digits) are cut.
SHOWN_CHARS = 40


def _short(value) -> str:
    """`repr(value)`, cut to `SHOWN_CHARS` (an int of 5000 digits has no repr at all)."""
    try:
        text = repr(value)
    except ValueError:  # ints of over 4300 digits (sys.get_int_max_str_digits) are not written
        return f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 3]}... ({len(text)} characters)"


def one_of(where: str, value, allowed: tuple, *, error: type[Exception] = PartitioningError):
    """`value` if it is one of `allowed` (and of the same type: `True` is no stage 1),
    else `error` listing them."""
    if not any(type(value) is type(x) and value == x for x in allowed):
        kind = "a bool, " if isinstance(value, bool) else ""  # True == 1, yet it is no stage 1
        raise error(f"{where}={_short(value)} is {kind}not one of {', '.join(map(str, allowed))}: give one of them")
    return value


def axis_names(where: str, value, *, optional: bool = True, error: type[Exception] = PartitioningError):
    """A tuple of mesh axis names: a string alone is refused (it would be read letter by
    letter), as is anything but strings inside."""
    if value is None and optional:
        return None
    if isinstance(value, str):
        raise error(f"{where}={value!r} is a string: give a tuple of axis names, e.g. ({value!r},)")
    try:
        names = tuple(value)
    except TypeError:
        raise error(f"{where}={value!r} is not a tuple of axis names: give e.g. ('data', 'model')") from None
    bad = [a for a in names if not isinstance(a, str)]
    if bad:
        raise error(f"{where}={value!r} holds {bad[0]!r}, which is not an axis name: give strings, "
                    "e.g. ('data', 'model')")
    twice = [a for i, a in enumerate(names) if a in names[:i]]
    if twice:
        raise error(f"{where}={value!r} names {twice[0]!r} twice: give each axis once, e.g. "
                    f"{tuple(dict.fromkeys(names))!r}")
    return names


def text(where: str, value, *, example: str, error: type[Exception] = PartitioningError) -> str:
    """A string setting (an axis name, a pattern)."""
    if not isinstance(value, str):
        raise error(f"{where}={value!r} is {a(type(value).__name__)}, not a string: give e.g. {example}")
    return value


def pattern(where: str, value, *, error: type[Exception] = PartitioningError) -> str:
    """An input pattern: a glob, or a `re:` regular expression that compiles."""
    text(where, value, example="'params/layers/*/mlp/w1' or 're:.*w1'", error=error)
    if value.startswith("re:"):
        try:
            re.compile(value[3:])
        except re.error as e:
            raise error(f"{where}={value!r} is not a valid regular expression ({e}): fix it, or drop the "
                        "'re:' prefix to match a glob such as 'params/*/w1'") from None
    return value


class AmbiguousPatternWarning(UserWarning):
    """A glob matched inputs that no glob can tell apart: a dict key holding '/' makes
    `{'a/b': x}` and `{'a': {'b': y}}` both `a/b` in the `/`-joined keys globs match."""


def warn_alike_paths(where: str, pattern: str, program, hits) -> None:
    """Warn (`AmbiguousPatternWarning`) when glob `pattern` matched inputs `hits` of
    `program` among which two join their keys to the same path: the glob cannot have
    meant one of them alone. Warned, not refused, because the match is what the glob
    says and a user may want both; the message names the `re:` pattern that picks one
    (names, unlike joined keys, keep a key's '/' inside its brackets)."""
    if pattern.startswith("re:"):
        return
    by_path: dict[str, list[str]] = {}
    for v in hits:
        name = program.name(v)
        by_path.setdefault(joined_keys(name), []).append(name)
    for path, names in by_path.items():
        if len(names) > 1:
            warnings.warn(f"{where} {pattern!r} matches {' and '.join(names)}, whose keys join to the same path "
                          f"{path!r} (a dict key holds '/'): all of them are used; to name one, write a regular "
                          f'expression on its name, e.g. r"re:^{re.escape(names[0])}$"',
                          AmbiguousPatternWarning, stacklevel=3)
            return
