"""Errors and warnings raised by the partitioning IR."""

from __future__ import annotations


class PartitioningError(ValueError):
    """A partitioning request that cannot be honoured.

    The message names the thing (a value, an axis, a dim), the problem, and the fix.
    Nothing is half-applied when it is raised: the state is as it was before the call.
    """


class UnknownPrimitiveWarning(UserWarning):
    """A primitive without a partitioning rule was lifted.

    Its operands and results are treated as replicated, which is always correct but may
    cost communication. Register a rule with `partir.rules.register` to do better.
    """
