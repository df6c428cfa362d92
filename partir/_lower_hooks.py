"""What the `jit` lowering does beside re-running each equation: how values are read.

`JitHooks` is what `partir._lower._eval_region` calls for every value it defines
(`constrain`, `record`) and for what each equation reads (`operands`): it constrains
values to the plan's layouts, makes XLA move values where the plan says (`Reads`), and
recomputes rematerialized residuals for the backward pass (`Recomputation`).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from ._errors import PartitioningError
from ._nested import Link


def _numeric(dtype) -> bool:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


class JitHooks:
    """The hooks of one lowered plan: `constrain(x, v)` fixes value `v`'s layout,
    `record` keeps the values of the current trace by id, `operands` rewrites what an
    equation reads, `produced` notes what an op made."""

    def __init__(self, part, mesh, constrain):
        self.prog = part.program
        self.constrain = constrain
        self.reads = Reads(part, mesh)
        self.remat = Recomputation(part, self) if part.rematerialized else None
        self.values: dict = {}

    def start(self) -> None:
        """Forget a previous trace."""
        self.reads.clear()
        self.values = {}
        if self.remat is not None:
            self.remat.clear()

    def record(self, v: int, x) -> None:
        """Keep value `v` of the trace (what recomputation starts from)."""
        self.values[v] = x

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

class Reads:
    """Makes XLA move values where the plan says, as the cost model counts them.

    An op that reads a value split along a dim its rule blocks (a convolution's spatial
    dim) reads it through a sharding constraint to the layout the plan says it computes
    with: XLA then moves it there, instead of computing the op some other way
    (exchanging halos). Readers of one value in one layout within one pass and one loop
    body share one copy (moved once per pass).

    And the backward pass moves a forward value again, as FSDP re-gathers a parameter
    for its backward matmuls and sequence parallelism an activation: left alone, XLA
    would merge the backward's all-gather with the forward's (common subexpression
    elimination) and keep the gathered buffer alive in between. Such a read goes through
    an `optimization_barrier` taken together with one of the op's backward operands (or
    the latest backward value), so the move can only happen in the backward pass."""

    def __init__(self, part, mesh):
        self.part, self.mesh = part, mesh
        self.prog = part.program
        self.made, self.last = {}, None

    def clear(self) -> None:
        """Forget the copies of a previous trace."""
        self.made, self.last = {}, None

    def _forward(self, v: int) -> bool:
        prog = self.prog
        for _ in range(64):  # through call boundaries to where the value is made
            p = prog.producer[v]
            if p < 0:
                return True
            op = prog.ops[p]
            if not (op.link and op.primitive == Link.CALL_IN) or op.operands[0] < 0:
                return not prog.backward[p]
            v = op.operands[0]
        return False

    def _moved(self, oid: int) -> list[int]:
        prog, part = self.prog, self.part
        op = prog.ops[oid]
        return [k for k, v in enumerate(op.operands)
                if v >= 0 and prog.values[v].shape and _numeric(prog.values[v].dtype)
                and part.required(oid, k).dims != part.tiling(v).dims and not prog.rematerializable(v)]

    def _pinned(self, oid: int, k: int) -> bool:
        """Must operand `k` of op `oid` be constrained to the layout the op reads it in?
        Where its at-rest layout splits a dim the op's rule blocks (a convolution's
        spatial dim), XLA would otherwise compute the op its own way (exchanging halos);
        elsewhere it reshards as the plan says on its own."""
        op, v = self.prog.ops[oid], self.prog.ops[oid].operands[k]
        blocked = set(op.rule.blocked)
        return any(axes and any(f in blocked for f in op.rule.operands[k][d])
                   for d, axes in enumerate(self.part.tiling(v).dims))

    def __call__(self, oid: int, invals, rid: int):
        prog, part = self.prog, self.part
        if part.classes.trivial[oid]:
            return invals
        moved = self._moved(oid)
        if not moved:
            return invals
        op, backward = prog.ops[oid], prog.backward[oid]
        anchor = next((k for k, v in enumerate(op.operands) if v >= 0 and k not in moved and not self._forward(v)), None)
        invals = list(invals)
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
                if self._pinned(oid, k):
                    x = jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, need.spec()))
                self.made[key] = x
            invals[k] = self.made[key]
        return invals

    def produced(self, oid: int, outs) -> None:
        """Remember the latest value the backward pass made (to order unary readers)."""
        if self.prog.backward[oid] and outs:
            self.last = outs[0]




class Recomputation:
    """Recomputes rematerialized residuals where the backward pass reads them: the
    first backward read of a layer's residual runs again the forward ops that remake all
    of that layer's recomputed residuals (`partir.recompute`), from the kept values they
    come from, taken through an `optimization_barrier` together with a backward value so
    that XLA can neither merge the recomputation with the forward pass nor move it
    earlier. The forward residual is then read by nothing after the forward pass, and
    XLA frees it."""

    def __init__(self, part, hooks):
        from ._remat import _call_roots, blocks, recompute

        prog = self.prog = part.program
        self.hooks = hooks
        self.rec = recompute(prog, part.rematerialized)
        self.root = prog.analysis(_call_roots)
        self.block_of = {self.root[r]: b for b, rs in self.rec.by_block.items() for r in rs}
        self.residual_of = {self.root[r]: r for rs in self.rec.by_block.values() for r in rs}
        self.ops = {b.index: [o for o in self.rec.ops if o in set(b.ops)] for b in blocks(prog)}
        loops = [b.label for b in blocks(prog) if b.loop >= 0 and b.index in self.rec.by_block]
        if loops:
            raise PartitioningError(f"rematerializing the residuals of a scan ({', '.join(loops)}) is not "
                                    "lowered yet: write the layers unrolled, or leave Remat out of this plan")
        self.done: dict = {}
        self.last = None

    def clear(self) -> None:
        """Forget a previous trace."""
        self.done, self.last = {}, None

    def substitute(self, rid: int, i: int, eqn, ids, invals):
        """Backward reads of recomputed residuals read the recomputed values."""
        prog = self.prog
        oid = prog.regions[rid].eqn_ops[i]
        backward = prog.backward[oid] if oid >= 0 else "transpose(" in str(eqn.source_info.name_stack)
        if not backward:
            return invals
        hit = [k for k, u in enumerate(ids) if u >= 0 and self.root[u] in self.block_of]
        if not hit:
            self._remember(ids, invals)
            return invals
        invals = list(invals)
        anchor = next((invals[k] for k, u in enumerate(ids) if u >= 0 and k not in hit), self.last)
        for k in hit:
            r = self.residual_of[self.root[ids[k]]]
            invals[k] = self._block(self.block_of[self.root[r]], anchor)[r]
        return invals

    def _remember(self, ids, invals) -> None:
        for u, x in zip(ids, invals):
            if u >= 0 and hasattr(x, "shape"):
                self.last = x
                return

    def _block(self, b: int, anchor) -> dict:
        """The recomputed values of block `b` (made on its first backward read)."""
        if b in self.done:
            return self.done[b]
        prog, values = self.prog, self.hooks.values
        sources = sorted({s for r in self.rec.by_block[b] for s in self.rec.sources[r]})
        kept = tuple(values[s] for s in sources)
        if anchor is not None:
            kept, _ = jax.lax.optimization_barrier((kept, anchor))
        local = dict(zip(sources, kept))
        for o in self.ops[b]:
            op = prog.ops[o]
            if op.link:
                if op.operands[0] >= 0 and op.results[0] >= 0:
                    local[op.results[0]] = local.get(op.operands[0], values.get(op.operands[0]))
                continue
            args = [local[u] if u >= 0 else x.val for u, x in zip(op.operands, op.eqn.invars)]
            outs = op.eqn.primitive.bind(*args, **op.eqn.params)
            outs = outs if op.eqn.primitive.multiple_results else [outs]
            for r, x in zip(op.results, outs):
                if r >= 0:
                    local[r] = self.hooks.constrain(x, r)
        self.done[b] = local
        return local
