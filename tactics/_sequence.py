"""Megatron-style sequence parallelism."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from partir import PartitioningError

from . import _checks as check
from ._base import Context, Tactic, TacticError


@dataclass(frozen=True)
class SequenceParallel(Tactic):
    """Split the sequence dim of the activations between tensor-parallel blocks (layer
    norms, residual adds, dropout) over `axis`, the axis of an earlier `Megatron`.

    Textbook pattern (Korthikanti et al.): where Megatron all-reduces a block's output,
    sequence parallelism reduce-scatters it onto the sequence dim, and all-gathers the
    sequence before the next block's column-parallel matmul: the same bytes as the
    all-reduce, with the norms and residuals computed on 1/n of the tokens. The
    sequence dim is dim 1 of the `[batch, sequence, hidden]` activations.
    """

    splits_weights: ClassVar[bool] = True  # see Tactic.splits_weights

    axis: str

    def __post_init__(self):
        check.text("SequenceParallel axis", self.axis, example="axis='model'", error=TacticError)

    def apply(self, part, ctx: Context):
        blocks = ctx.blocks.get(self.axis)
        if not blocks:
            raise TacticError(f"SequenceParallel({self.axis!r}) needs Megatron({self.axis!r}) earlier in the schedule")
        prog = part.program
        outs = []
        for b in blocks:
            for o in b.reductions:
                op = prog.ops[o]
                if op.primitive not in ("dot_general", "gather"):
                    continue  # softmax statistics: nothing to split along the sequence
                outs += [v for v in op.results if v >= 0 and prog.values[v].rank >= 3]
        split = []
        for v in outs:
            t = part.tiling(v)
            if self.axis in t.axes():
                continue
            try:
                part.tile(v, 1, self.axis, source=str(self))
                split.append(prog.name(v))
            except PartitioningError as e:
                raise TacticError(f"cannot split the sequence dim of {prog.name(v)}: {e}") from e
        if not split and not outs:
            raise TacticError("the Megatron blocks end in no [batch, sequence, hidden] activation to split")
        return part, [f"block outputs split on the sequence dim over {self.axis!r}: {len(split)}"]
