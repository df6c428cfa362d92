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
from ._eval import bind_equation, lowering_params
from ._nested import Link
from ._reshard import gathered_first
from .rules._indexing import ADDITIVE_SCATTERS, OTHER_SCATTERS


#: Ops that read or write at indices: what they move is constrained to the layout they
#: read it in. Left to move it themselves, XLA's gather partitioner can emit a gather
#: its own verifier rejects (an operand split along a sliced dim, all-reduced, then
#: sliced past its local size).
INDEXED = ("gather", *ADDITIVE_SCATTERS, *OTHER_SCATTERS)


def _numeric(dtype) -> bool:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


class JitHooks:
    """The hooks of one lowered plan: `constrain(x, v)` fixes value `v`'s layout,
    `record` keeps the values of the current trace by id, `operands` rewrites what an
    equation reads, `produced` notes what an op made."""

    def __init__(self, part, mesh, constrain):
        self.prog = part.program
        self.mesh = mesh
        self.constrain = constrain
        self.reads = Reads(part, mesh, self.remake)
        self.remat = Recomputation(part, self) if part.rematerialized or part.reused else None
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

    def remake(self, v: int):
        """Value `v`, made from scalars alone (`Program.rematerializable`), made again
        from this trace's scalars."""
        op = self.prog.ops[self.prog.producer[v]]
        args = [self.values[u] if u >= 0 else var.val for u, var in zip(op.operands, op.eqn.invars)]
        return bind_equation(op.eqn, args)[op.results.index(v)]

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
        from ._nested import split_operands

        run.values = self.values
        return self.remat.scans.evaluate(eqn, children, split_operands(eqn, invals), run)

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
        if op.primitive in INDEXED:
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




class Recomputation:
    """Recomputes rematerialized residuals where the backward pass reads them: the
    first backward read of a layer's residual runs again the forward ops that remake all
    of that layer's recomputed residuals (`partir.recompute`), from the kept values they
    come from, taken through an `optimization_barrier` together with a backward value so
    that XLA can neither merge the recomputation with the forward pass nor move it
    earlier. The forward residual is then read by nothing after the forward pass, and
    XLA frees it.

    And reads the forward values a relaxed user checkpoint reuses (`Partitioning.reuse`):
    a read of a reused value in the checkpoint's backward region reads its forward twin
    (in a scan's backward body, its slice of the stack the forward loop makes of it); the
    twin's own op is then dead, and XLA drops it."""

    def __init__(self, part, hooks):
        from ._checkpoint import relaxation
        from ._remat import _call_roots, blocks, recompute

        prog = self.prog = part.program
        self.hooks = hooks
        self.rec = recompute(prog, part.rematerialized)
        self.root = prog.analysis(_call_roots)
        self.block_of = {self.root[r]: b for b, rs in self.rec.by_block.items() for r in rs}
        self.residual_of = {self.root[r]: r for rs in self.rec.by_block.values() for r in rs}
        self.ops = {b.index: [o for o in self.rec.ops if o in set(b.ops)] for b in blocks(prog)}
        reads = relaxation(prog, part.reused).reads
        self.reuse = {self.root[w]: v for w, v in reads.items()}
        self.scans = ScanRemat(prog, self.rec, [b for b in blocks(prog) if b.loop >= 0 and b.index in self.rec.by_block],
                               reads)
        self.scans.owner = self
        self.block_of.update({self.root[s]: b for s, b in self.scans.slice_block.items()})
        self.residual_of.update({self.root[s]: r for s, r in self.scans.slice_residual.items()})
        self.done: dict = {}
        self.last: dict = {}  # per backward scan body (-1: outside), the latest backward value read

    def clear(self, body: int | None = None) -> None:
        """Forget a previous trace (of the backward scan body `body` only, when given:
        `lax.scan` may trace a body more than once)."""
        if body is None:
            self.done, self.last = {}, {}
            return
        self.done = {k: v for k, v in self.done.items() if k[1] != body}
        self.last.pop(body, None)

    def substitute(self, rid: int, i: int, eqn, ids, invals):
        """Backward reads of recomputed residuals read the recomputed values."""
        prog = self.prog
        oid = prog.regions[rid].eqn_ops[i]
        backward = prog.backward[oid] if oid >= 0 else "transpose(" in str(eqn.source_info.name_stack)
        if not backward:
            return invals
        body = self.scans.body_of(rid)
        if any(u >= 0 and self.root[u] in self.reuse for u in ids):
            invals = [self._reused(u, body) if u >= 0 and self.root[u] in self.reuse else x
                      for u, x in zip(ids, invals)]
        hit = [k for k, u in enumerate(ids) if u >= 0 and self.root[u] in self.block_of]
        if not hit:
            self._remember(ids, invals, body)
            return invals
        invals = list(invals)
        anchor = next((invals[k] for k, u in enumerate(ids) if u >= 0 and k not in hit), self.last.get(body))
        for k in hit:
            r = self.residual_of[self.root[ids[k]]]
            invals[k] = self._block(self.block_of[self.root[ids[k]]], anchor, rid)[r]
        return invals

    def _reused(self, u: int, body: int):
        """The forward value read for reused value `u` (once per backward body trace)."""
        key = (("reuse", self.root[u]), body)
        if key not in self.done:
            v = self.reuse[self.root[u]]
            self.done[key] = self._forward_value(self.scans.source(v, body, self._values()), v, u)
        return self.done[key]

    def _values(self):
        return self.hooks.values

    def _forward_value(self, x, v: int, u: int):
        """Forward value `v`'s `x` as the value `u` it stands for (in `u`'s layout)."""
        return self.hooks.constrain(x, u)

    def _remember(self, ids, invals, body: int) -> None:
        for u, x in zip(ids, invals):
            if u >= 0 and hasattr(x, "shape"):
                self.last[body] = x
                return

    def _block(self, b: int, anchor, rid: int = 0) -> dict:
        """The recomputed values of block `b` (made on its first backward read; in a
        scan's backward body, from that body's slices)."""
        key = (b, self.scans.body_of(rid))
        if key in self.done:
            return self.done[key]
        prog, values = self.prog, self.hooks.values
        sources = sorted({s for r in self.rec.by_block[b] for s in self.rec.sources[r]})
        kept = tuple(self.scans.source(s, key[1], values) for s in sources)
        if anchor is not None:
            kept, _ = jax.lax.optimization_barrier((kept, anchor))
        local = dict(zip(sources, kept))
        by_root = {self.root[s]: x for s, x in local.items()}  # a kept input read through a call's copy

        def get(u):
            return local[u] if u in local else by_root[self.root[u]]

        for o in self.ops[b]:
            op = prog.ops[o]
            if op.link:
                if op.operands[0] >= 0 and op.results[0] >= 0:
                    local[op.results[0]] = get(op.operands[0])
                continue
            args = [get(u) if u >= 0 else x.val for u, x in zip(op.operands, op.eqn.invars)]
            outs = bind_equation(op.eqn, args, **lowering_params(op.eqn, self.hooks.mesh))
            for r, x in zip(op.results, outs):
                if r >= 0:
                    local[r] = self.hooks.constrain(x, r)
        self.done[key] = local
        return local


class ScanRemat:
    """Rematerialization across a scan's two loops. The forward loop stacks, for each
    recomputed residual, a scalar instead of the residual (nothing reads it), and stacks
    in addition what recomputing needs that it does not stack already (its layer input,
    say); the backward loop slices those extra stacks, and recomputes the residuals in
    its body from its slices of the kept stacks and of the extra ones."""

    def __init__(self, program, rec, loop_blocks, reuse=None):
        from ._remat import layer_blocks

        self.prog = program
        self.fwd = {b.loop: b for b in loop_blocks}  # forward body region -> block
        reused = {}  # forward body -> the forward values relaxed checkpoints in the backward body read
        for w, v in (reuse or {}).items():
            fwd, bwd = _loop_of(program, v), _loop_of(program, w)
            if fwd >= 0 and bwd >= 0:
                self.fwd.setdefault(fwd, next(b for b in layer_blocks(program) if b.loop == fwd))
                reused.setdefault(fwd, []).append(v)
        stacked, sliced, self.slice_block, self.slice_residual = {}, {}, {}, {}
        for op in program.ops:
            if op.link and op.primitive == Link.SCAN_YS:
                stacked[op.operands[0]] = op.results[0]
            elif op.link and op.primitive == Link.SCAN_XS:
                sliced[(op.operands[0], program.values[op.results[0]].region)] = op.results[0]
        self.stacked, self.sliced = stacked, sliced
        gone = {r for b in loop_blocks for r in rec.by_block[b.index]}
        self.placeholders = {stacked[r] for r in gone if r in stacked}
        self.bwd: dict[int, int] = {_loop_of(program, w): _loop_of(program, v)  # backward body -> forward body
                                    for w, v in (reuse or {}).items() if _loop_of(program, v) >= 0}
        for (stack, body), s in sliced.items():
            r = next((r for r in gone if stacked.get(r) == stack), None)
            if r is not None:
                fwd = program.values[r].region
                self.bwd[body] = fwd
                self.slice_block[s], self.slice_residual[s] = self.fwd[fwd].index, r
        self.extra: dict[int, list] = {}  # forward body -> the body values it stacks in addition
        self.sliced_sources: dict[int, list] = {}  # forward body -> (its slice, the stacked input)
        for fwd, b in self.fwd.items():
            srcs = sorted({s for r in rec.by_block.get(b.index, ()) for s in rec.sources[r]})
            self.extra[fwd] = [s for s in srcs if program.values[s].region == fwd and s not in stacked
                               and not _loop_input(program, s)]
            self.extra[fwd] += [v for v in dict.fromkeys(reused.get(fwd, ())) if v not in stacked
                                and v not in self.extra[fwd]]
            self.sliced_sources[fwd] = [(s, program.ops[program.producer[s]].operands[0]) for s in srcs
                                        if _loop_input(program, s, Link.SCAN_XS)]
        self.stacks: dict[int, tuple] = {}  # forward body -> its extra stacks (this trace)
        self.owner = None  # the Recomputation using this
        self.slices: dict[int, dict] = {}  # backward body -> source -> its slice (this trace)

    def body_of(self, rid: int) -> int:
        """The backward body region `rid` is in (itself, or the body holding the call or
        `jax.checkpoint` region `rid`; -1 outside any)."""
        while rid >= 0 and rid not in self.bwd:
            region = self.prog.regions[rid]
            if region.kind in ("scan", "while.body", "while.cond"):
                return -1  # another loop's body: its values are not this body's
            rid = region.parent
        return rid

    def source(self, s: int, body: int, values):
        """The value of source `s` of a recomputation in backward body `body` (-1: none)."""
        if body < 0:
            return values[s]
        if s in self.slices.get(body, {}):
            return self.slices[body][s]
        stack = self.stacked.get(s)
        if stack is not None and (stack, body) in self.sliced:
            return values[self.sliced[(stack, body)]]
        op = self.prog.ops[self.prog.producer[s]] if self.prog.producer[s] >= 0 else None
        if op is not None and op.link and (op.operands[0], body) in self.sliced:
            return values[self.sliced[(op.operands[0], body)]]  # a stacked parameter's slice
        if op is not None and op.link and op.primitive == Link.SCAN_CONST:
            return values[op.operands[0]]  # a loop constant, from outside both loops
        if self.prog.values[s].region != self.bwd.get(body, -2) and self.prog.producer[s] >= 0:
            raise PartitioningError(f"recomputing in scan body #{body} needs {self.prog.name(s)}, which the forward "
                                    "loop neither stacks nor is asked to")
        return values[s]

    def evaluate(self, eqn, children, ins, run):
        """The scan `eqn` evaluated with its rematerialization, or None if it has none."""
        (child,) = children
        if child in self.fwd and self.fwd[child].index is not None:
            return self._forward(eqn, child, ins, run)
        if child in self.bwd:
            return self._backward(eqn, child, ins, run)
        return None

    def _forward(self, eqn, child, ins, run):
        p = eqn.params
        nk = len(ins.carry)
        region = self.prog.regions[child]
        drop = [k for k, v in enumerate(region.outvars[nk:]) if self.stacked.get(v) in self.placeholders]
        hooks_values = {}

        def body(carry, x):
            outs = run(child, [*ins.consts, *carry, *x])
            ys = list(outs[nk:])
            for k in drop:
                ys[k] = jax.numpy.zeros((), ys[k].dtype)
            extra = tuple(run.values[s] for s in self.extra[child])
            return tuple(outs[:nk]), (tuple(ys), extra)

        carry, (ys, extra) = jax.lax.scan(body, tuple(ins.carry), tuple(ins.xs), length=p["length"],
                                          reverse=p["reverse"], unroll=p["unroll"])
        self.stacks[child] = extra
        del hooks_values
        return [*carry, *ys]

    def _backward(self, eqn, child, ins, run):
        p = eqn.params
        nk, nx = len(ins.carry), len(ins.xs)
        fwd = self.bwd[child]
        more = [(s, stack) for s, stack in self.sliced_sources[fwd] if (stack, child) not in self.sliced]
        extra_stacks = tuple(self.stacks.get(fwd, ())) + tuple(run.values[stack] for _, stack in more)
        names = self.extra[fwd] + [s for s, _ in more]

        def body(carry, x):
            self.slices[child] = dict(zip(names, x[nx:]))
            self.owner.clear(child)
            outs = run(child, [*ins.consts, *carry, *x[:nx]])
            return tuple(outs[:nk]), tuple(outs[nk:])

        carry, ys = jax.lax.scan(body, tuple(ins.carry), tuple(ins.xs) + tuple(extra_stacks), length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
        return [*carry, *ys]


def _loop_of(program, v: int) -> int:
    """The scan body value `v` is made in (through the calls inside it), or -1."""
    from ._checkpoint import scan_body_of

    return scan_body_of(program, program.values[v].region)


def _loop_input(program, s: int, kinds=(Link.SCAN_CONST, Link.SCAN_XS)) -> bool:
    """Is `s` a scan body's constant or its slice of a stacked input (which the backward
    loop can have too), rather than something the loop makes or carries?"""
    p = program.producer[s]
    return p >= 0 and program.ops[p].link and program.ops[p].primitive in kinds
