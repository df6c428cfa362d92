"""Op traits: what the cost model and the lowerings know of a primitive beside its factor
rule, in one table filled where each rule is registered (`register(..., traits=...)`).

- `work`: how XLA's `HloCostAnalysis` counts the op's flops (`Work`), with `flops` and
  `transcendentals` per result element (elementwise) or per element reduced (reduction);
  figures measured with `compiled.cost_analysis()` on this JAX version where XLA expands
  the primitive into many operations (`igamma`, `zeta`, threefry);
- `fusion`: how XLA fuses it (`Fusion`): duplicated into every consumer, into its only
  reader, or a fusion that takes its producers in;
- `view`: its result is a view of its operand's buffer (a bitcast in XLA's row-major
  layouts);
- `creates`: it makes values from shapes or scalars alone (an iota, a broadcast);
- `indexed`: it reads or writes at indices (a gather, a scatter): the lowering
  constrains what it moves to the layout it reads it in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Work(enum.StrEnum):
    """How an op's flops are counted (XLA's `HloCostAnalysis`)."""

    ELEMENTWISE = "elementwise"  # `flops` and `transcendentals` per result element
    POWER = "power"  # |y| - 1 multiplications per element (`integer_pow`)
    POLYNOMIAL = "polynomial"  # 2 flops per coefficient per element (Horner's rule)
    REDUCTION = "reduction"  # `flops` per element reduced (operand minus result elements)
    CONTRACTION = "contraction"  # 2 * result elements * contracted size
    CONVOLUTION = "convolution"  # 2 * batch * features out * features in * valid taps
    WINDOW = "window"  # result elements * (window elements - 1)
    WINDOW_GRAD = "window_grad"  # 7.5 per source element per window element (measured)
    SCATTER = "scatter"  # one per update element
    SCAN = "scan"  # 2 log2(n) per element along the scanned or sorted dim
    REGION = "region"  # a region partitioned by hand: its body's work on one device
    MOVE = "move"  # data movement or bookkeeping: no flops


class Fusion(enum.StrEnum):
    """How XLA fuses an op (its `IsExpensive` and its fusion kinds)."""

    CHEAP = "cheap"  # computed inside the fusions of its consumers, duplicated into each
    EXPENSIVE = "expensive"  # fused into a consumer only when that is its one reader
    INPUT = "input"  # a reduction: an input fusion takes its elementwise producers in
    CONSUMER = "consumer"  # a broadcast: takes its elementwise producers in, not cheap itself
    NONE = "none"  # a kernel of its own: its results are buffers

    @property
    def fuses_producers(self) -> bool:
        """Does a fusion rooted at such an op take its elementwise producers in?"""
        return self is not Fusion.NONE


@dataclass(frozen=True, slots=True)
class Traits:
    """One primitive's traits (module docstring)."""

    work: Work
    fusion: Fusion = Fusion.NONE
    flops: float = 0.0
    transcendentals: float = 0.0
    view: bool = False
    creates: bool = False
    indexed: bool = False


def arithmetic(flops: float = 1.0, fusion: Fusion = Fusion.CHEAP) -> Traits:
    """An elementwise op of `flops` flops per element."""
    return Traits(Work.ELEMENTWISE, fusion, flops=flops)


def transcendental(n: float = 1.0, flops: float = 0.0, fusion: Fusion = Fusion.EXPENSIVE) -> Traits:
    """An elementwise op of `n` transcendentals (and `flops` flops) per element."""
    return Traits(Work.ELEMENTWISE, fusion, flops=flops, transcendentals=n)


#: Data movement XLA fuses into its consumers (a transpose, a slice, a pad).
MOVE_FUSED = Traits(Work.MOVE, Fusion.CHEAP)
#: A view of its operand's buffer (reshape, squeeze, expand_dims).
VIEW = Traits(Work.MOVE, Fusion.CHEAP, view=True)
#: An op of its own that moves or books data and computes nothing (a sort's payload,
#: a call, a callback, an identity of several values).
OPAQUE = Traits(Work.MOVE)
