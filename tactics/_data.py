"""Data parallelism."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from . import _checks as check
from ._base import Context, Tactic, TacticError
from ._roles import roles


def batch_inputs(part, batch_argnums=None) -> tuple[list[int], str]:
    """The batch inputs of a program and how they were found: the inputs of the given
    arguments, or else the non-state inputs whose leading dim is the most common one."""
    prog = part.program
    if batch_argnums is not None:
        wanted = {batch_argnums} if isinstance(batch_argnums, int) else set(batch_argnums)
        found = [v for v, a in zip(prog.inputs, prog.input_args) if a in wanted and prog.values[v].rank >= 1]
        if not found:
            raise TacticError(f"batch_argnums={batch_argnums} select no array input of rank >= 1")
        return found, f"given by batch_argnums={batch_argnums}"
    cands = roles(prog).batch
    if not cands:
        raise TacticError("found no batch input (every input is a parameter or optimizer state); "
                          "pass batch_argnums=")
    lead, _ = Counter(prog.values[v].shape[0] for v in cands).most_common(1)[0]
    found = [v for v in cands if prog.values[v].shape[0] == lead]
    return found, f"inferred: inputs that are not carried to an output, leading dim {lead}"


@dataclass(frozen=True)
class DataParallel(Tactic):
    """Split the batch (leading) dim of the batch inputs over `axis`.

    Textbook pattern: every device runs the whole model on its slice of the batch; the
    weight gradients are all-reduced over `axis` once per step (reduce-scattered when a
    later ZeRO tactic shards what consumes them).
    """

    axis: str
    batch_argnums: tuple[int, ...] | int | None = None

    def __post_init__(self):
        check.text("DataParallel axis", self.axis, example="axis='data'", error=TacticError)

    def apply(self, part, ctx: Context):
        found, how = batch_inputs(part, self.batch_argnums)
        size = part.mesh.size(self.axis)
        bad = [part.program.name(v) for v in found if part.program.values[v].shape[0] % size]
        if bad:
            raise TacticError(f"axis {self.axis!r} (size {size}) does not divide the batch dim of {', '.join(bad)}")
        for v in found:
            part.tile(v, 0, self.axis, source=str(self))
        names = ", ".join(part.program.name(v) for v in found)
        return part, [f"batch inputs ({how}): {names}"]
