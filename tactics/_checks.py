"""Checks of settings given by a user (a tactic's fields, automap's arguments), made
when they are given so that a wrong one fails before any work, with the thing, the
problem and the fix in the message."""

from __future__ import annotations

import math
import numbers
import re

from partir import PartitioningError


def a(noun: str) -> str:
    """'a str', 'an int'."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def number(where: str, value, *, integer: bool = False, optional: bool = False, sign: str = "positive",
           example: str = "", error: type[Exception] = PartitioningError):
    """`value` checked to be a real number (an int when `integer`), finite, and of `sign`
    ("positive": > 0, "non-negative": >= 0, "any"); `None` passes when `optional`.
    Booleans and strings are not numbers. Returns it as a float (an int when
    `integer`). `where` names the setting, e.g. "AutomaticPartition budget_s";
    `example` shows a good value."""
    if value is None and optional:
        return None
    want = ("an integer" if integer else "a finite number") if sign == "any" else \
        f"a {sign} {'integer' if integer else 'finite number'}"
    fix = f"give {want}{' or None' if optional else ''}" + (f", e.g. {example}" if example else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        raise error(f"{where}={value!r} is {a(type(value).__name__)}, not {'an integer' if integer else 'a number'}: {fix}")
    if not math.isfinite(value):
        raise error(f"{where}={value!r} is not finite: {fix}")
    if (sign == "positive" and value <= 0) or (sign == "non-negative" and value < 0):
        raise error(f"{where}={value!r} is out of range: {fix}")
    return int(value) if integer else float(value)


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
