"""Expert parallelism for mixture-of-experts layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from partir import Tiling

from . import _checks as check
from ._base import Context, Tactic, TacticError
from ._data import batch_inputs
from ._roles import roles, weight_root


def expert_weights(prog, params, forward_end) -> list[tuple[int, int]]:
    """(weight input, experts dim) for parameters a forward matmul reads batched over
    one of the weight's dims: one weight per expert."""
    found = {}
    for op in prog.ops[:forward_end]:
        if op.primitive != "dot_general":
            continue
        (_, _), (lb, rb) = op.eqn.params["dimension_numbers"]
        for k, b in ((0, lb), (1, rb)):
            root = weight_root(prog, op.operands[k]) if len(b) == 1 else None
            if root is not None and root[0] in params:
                found.setdefault(root[0], b[0] + root[1])
    return sorted(found.items())


def expert_activations(prog, weights) -> list[tuple[int, int]]:
    """(value, experts dim) for the activations entering and leaving the experts'
    matmuls, forward and backward: every operand and result of rank >= 3 of a matmul
    batched over one dim that reads an expert weight or makes its gradient."""
    classes = prog.classes
    weight_classes = {classes.of[w] for w, _ in weights}
    roots = {w for w, _ in weights}

    def expertish(v):
        if v < 0:
            return False
        root = weight_root(prog, v)
        if root is not None and root[0] in roots:
            return True
        if classes.of[v] in weight_classes:
            return True
        return any(prog.ops[u].primitive == "transpose" and classes.of[prog.ops[u].results[0]] in weight_classes
                   for u in prog.users[v])

    out = []
    for op in prog.ops:
        if op.primitive != "dot_general":
            continue
        (_, _), (lb, rb) = op.eqn.params["dimension_numbers"]
        if len(lb) != 1 or not any(expertish(v) for v in (*op.operands, *op.results)):
            continue
        for v, d in ((op.operands[0], lb[0]), (op.operands[1], rb[0]), (op.results[0], 0)):
            if v >= 0 and not expertish(v) and prog.values[v].rank >= 3:
                out.append((v, d))
    return out


@dataclass(frozen=True)
class ExpertParallel(Tactic):
    """Split the experts of MoE layers over `axis`, and the tokens (the batch) over the
    same axis so that routing stays local.

    Textbook pattern (GShard/Switch): each device routes its own tokens; an all-to-all
    sends every expert its dispatched tokens (group-split -> expert-split), the experts
    run where their weights live, and a second all-to-all brings the results back for
    the combine; expert weights need no gradient reduction over `axis`. The tensors
    entering and leaving the experts are fixed expert-split first (`constrain`, a
    layout boundary), so that the routing's token split and the experts' split meet
    there, in the all-to-alls, instead of one overriding the other.
    """

    splits_weights: ClassVar[bool] = True  # see Tactic.splits_weights

    axis: str
    batch_argnums: tuple[int, ...] | int | None = None

    def __post_init__(self):
        check.text("ExpertParallel axis", self.axis, example="axis='data'", error=TacticError)

    def apply(self, part, ctx: Context):
        prog = part.program
        r = roles(prog)
        weights = expert_weights(prog, set(r.params), r.forward_end)
        if not weights:
            raise TacticError("found no expert weights (a parameter a forward matmul reads with a batch dim): "
                              "ExpertParallel needs a mixture-of-experts layer")
        for v, d in expert_activations(prog, weights):
            t = part.tiling(v)
            if self.axis not in t.axes():
                dims = list(t.dims)
                dims[d] = dims[d] + (self.axis,)
                part.constrain(v, Tiling(tuple(dims)), source=str(self))
        tokens, how = batch_inputs(part, self.batch_argnums)
        for v in tokens:
            part.tile(v, 0, self.axis, source=str(self))
        for w, d in weights:
            part.tile(w, d, self.axis, source=str(self))
        names = ", ".join(f"{prog.name(w)}[dim {d}]" for w, d in weights)
        return part, [f"tokens split over {self.axis!r} ({how})", f"expert weights split over {self.axis!r}: {names}"]
