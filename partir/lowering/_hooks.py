"""What the `jit` lowering does beside re-running each equation: how values are read.

`JitHooks` is what `partir.lowering._jit._eval_region` calls for every value it defines
(`constrain`, `record`) and for what each equation reads (`operands`): it constrains
values to the plan's layouts, makes XLA move values where the plan says (`Reads`), and
recomputes rematerialized residuals for the backward pass (`Recomputation`).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from .._errors import PartitioningError
from .._nested import Link, split_operands
from .._reshard import gathered_first
from ..rules import get_traits
from ._eval import bind_equation
from ._order import Reordering
from ._recompute import Recomputation


def _indexed(prim: str) -> bool:
    """Does the op read or write at indices (its traits' `indexed`: a gather, a scatter)?
    What it moves is then constrained to the layout it reads it in: left to move it
    itself, XLA's gather partitioner can emit a gather its own verifier rejects (an
    operand split along a sliced dim, all-reduced, then sliced past its local size)."""
    traits = get_traits(prim)
    return traits is not None and traits.indexed


def _numeric(dtype) -> bool:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


class JitHooks:
    """The hooks of one lowered plan: `constrain(x, v)` fixes value `v`'s layout,
    `record` keeps the values of the current trace by id, `operands` rewrites what an
    equation reads, `produced` notes what an op made; `order` is the plan's token
    orders (`_order.Reordering`)."""

    def __init__(self, part, mesh, constrain):
        self.prog = part.program
        self.mesh = mesh
        self.constrain = constrain
        self.order = Reordering(part)
        self.reads = Reads(part, mesh, self.remake)
        self.remat = Recomputation(part, self) if part.rematerialized or part.reused else None
        self.values: dict = {}
        # Pipelined layer scans run as shard_map regions (`_jit_pipeline.JitPipelines`).
        self.pipelines = ()

    def start(self) -> None:
        """Forget a previous trace."""
        self.reads.clear()
        self.values = {}
        if self.remat is not None:
            self.remat.clear()

    def record(self, v: int, x) -> None:
        """Keep value `v` of the trace (what recomputation starts from)."""
        self.values[v] = x

    def remake(self, v: int):
        """Value `v`, made from scalars alone (`Program.rematerializable`), made again
        from this trace's scalars."""
        op = self.prog.ops[self.prog.producer[v]]
        args = [self.values[u] if u >= 0 else var.val for u, var in zip(op.operands, op.eqn.invars)]
        return self.order.made(v, bind_equation(op.eqn, args)[op.results.index(v)])

    def operands(self, rid: int, i: int, eqn, ids, invals):
        """What equation `i` of region `rid` reads (`ids`: its operands' value ids)."""
        oid = self.prog.regions[rid].eqn_ops[i]
        if self.remat is not None:
            invals = self.remat.substitute(rid, i, eqn, ids, invals)
        if oid >= 0:
            invals = self.reads(oid, invals, rid)
        return invals

    def produced(self, oid: int, outs) -> None:
        """Note what op `oid` made."""
        if oid >= 0:
            self.reads.produced(oid, outs)

    def nested(self, eqn, children, invals, run):
        """A nested equation evaluated here (a scan with recomputed residuals), else None."""
        if self.remat is None or eqn.primitive.name != "scan":
            return None
        return self.remat.scans.evaluate(eqn, children, split_operands(eqn, invals), run, self.values)

def made_in_forward(prog, v: int) -> bool:
    """Is value `v` made by the forward pass (or an input), seen through call boundaries?"""
    for _ in range(64):  # through call boundaries to where the value is made
        p = prog.producer[v]
        if p < 0:
            return True
        op = prog.ops[p]
        if not (op.link and op.primitive == Link.CALL_IN) or op.operands[0] < 0:
            return not prog.backward[p]
        v = op.operands[0]
    return False


class Reads:
    """Makes XLA move values where the plan says, as the cost model counts them.

    An op that reads a value split along a dim its rule blocks (a convolution's spatial
    dim), or that computes whole along some mesh axis, reads what it moves through a
    sharding constraint to the layout the plan says it computes with: XLA then moves it
    there, instead of computing the op some other way (exchanging halos, or splitting it
    along the idle axis and permuting the result). A value made from scalars alone (a
    broadcast constant) that such an op reads in another layout is made again there, in
    that layout, as the cost model has it (it moves nothing); left in its own layout,
    XLA would split the op the way that value is split. Readers of one value in one
    layout within one pass and one loop body share one copy (moved once per pass).

    And the backward pass moves a forward value again, as FSDP re-gathers a parameter
    for its backward matmuls and sequence parallelism an activation: left alone, XLA
    would merge the backward's all-gather with the forward's (common subexpression
    elimination) and keep the gathered buffer alive in between. Such a read goes through
    an `optimization_barrier` taken together with one of the op's backward operands (or
    the latest backward value), so the move can only happen in the backward pass."""

    def __init__(self, part, mesh, remake):
        self.part, self.mesh, self.remake = part, mesh, remake
        self.prog = part.program
        self.made, self.last = {}, None

    def clear(self) -> None:
        """Forget the copies of a previous trace."""
        self.made, self.last = {}, None

    def _forward(self, v: int) -> bool:
        return made_in_forward(self.prog, v)

    def _moved(self, oid: int) -> tuple[list[int], list[int]]:
        """The operands op `oid` reads in a layout other than their own: those it moves,
        and those made from scalars alone that it remakes in its layout (when it must)."""
        prog, part = self.prog, self.part
        op = prog.ops[oid]
        other = [k for k, v in enumerate(op.operands)
                 if v >= 0 and prog.values[v].shape and _numeric(prog.values[v].dtype)
                 and part.required(oid, k).dims != part.tiling(v).dims]
        made = [k for k in other if prog.rematerializable(op.operands[k])]
        if made and not self._idle(oid):
            made = [k for k in made if self._pinned(oid, k)]
        return [k for k in other if not prog.rematerializable(op.operands[k])], made

    def _pinned(self, oid: int, k: int) -> bool:
        """Must operand `k` of op `oid` be constrained to the layout the op reads it in?
        Where its at-rest layout splits a dim the op's rule blocks (a convolution's
        spatial dim), XLA would otherwise compute the op its own way (exchanging halos);
        elsewhere it reshards as the plan says on its own."""
        op, v = self.prog.ops[oid], self.prog.ops[oid].operands[k]
        if _indexed(op.primitive):
            return True
        blocked = set(op.rule.blocked)
        return any(axes and any(f in blocked for f in op.rule.operands[k][d])
                   for d, axes in enumerate(self.part.tiling(v).dims))

    def _idle(self, oid: int) -> bool:
        """Does op `oid` compute whole along some mesh axis (of more than one device)?
        XLA would then split it along that idle axis itself, to do less work, and move
        its operands its own way: the operands it reads moved are constrained to the
        layout the plan reads them in, so that XLA computes it as planned."""
        used = {a for axes in self.part.factor_tiling(oid) for a in axes}
        return any(n > 1 and a not in used for a, n in self.part.mesh.sizes().items())

    def __call__(self, oid: int, invals, rid: int):
        prog, part = self.prog, self.part
        if part.classes.trivial[oid]:
            return invals
        moved, remade = self._moved(oid)
        if not moved and not remade:
            return invals
        op, backward = prog.ops[oid], prog.backward[oid]
        anchor = next((k for k, v in enumerate(op.operands) if v >= 0 and k not in moved and not self._forward(v)), None)
        invals = list(invals)
        for k in remade:
            x = self.remake(op.operands[k])
            invals[k] = jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, part.required(oid, k).spec()))
        for k in moved:
            need = part.required(oid, k)
            key = (op.operands[k], need.dims, backward, prog.regions[rid].parent >= 0 and rid)
            if key not in self.made:
                x = invals[k]
                if backward and self._forward(op.operands[k]):
                    if anchor is not None:
                        x, invals[anchor] = jax.lax.optimization_barrier((x, invals[anchor]))
                    elif self.last is not None:  # a unary reader: after the latest backward value
                        x, _ = jax.lax.optimization_barrier((x, self.last))
                via = gathered_first(part.tiling(op.operands[k]), need, part.mesh)
                if via is not None:
                    x = jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, via.spec()))
                if via is not None or self._pinned(oid, k) or self._idle(oid):
                    x = jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, need.spec()))
                self.made[key] = x
            invals[k] = self.made[key]
        return invals

    def produced(self, oid: int, outs) -> None:
        """Remember the latest value the backward pass made (to order unary readers)."""
        if self.prog.backward[oid] and outs:
            self.last = outs[0]
