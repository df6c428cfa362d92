"""Partitioning rules: one registry of factor rules keyed by primitive name.

Importing this package registers the rules of every family, each primitive with its
`Traits` (`get_traits`: how its work is counted, how XLA fuses it, views and indexed
ops; the cost model and the lowerings read them). `get_rule(name)` returns a rule
function `(in_shapes, out_shapes, params) -> FactorRule`, or None for primitives
without a rule (the IR then treats the op as replicated and warns once).
"""

from . import _dot, _elementwise, _indexing, _linalg, _manual, _misc, _reduce, _shape  # noqa: F401  (registration)
from ._registry import Namer, conservative_rule, get_rule, get_traits, register, registered
from ._traits import Fusion, Traits, Work

__all__ = ["Fusion", "Namer", "Traits", "Work", "conservative_rule", "get_rule", "get_traits", "register",
           "registered"]
