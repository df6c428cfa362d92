"""Rematerialization under the lowerings: which residuals are recomputed where the
backward pass reads them (`Recomputation`), and how a scan's two loops carry what
recomputing needs (`ScanRemat`). The jit lowering uses them as they are; the
shard_map lowering runs the recomputed ops on layers (`_shardmap_remat`)."""

from __future__ import annotations

import jax

from .._errors import PartitioningError
from .._checkpoint import relaxation, scan_body_of
from .._nested import Link
from .._graph import call_roots
from .._remat import layers_of, recompute, residual_layers
from ._eval import bind_equation, lowering_params


class Recomputation:
    """Recomputes rematerialized residuals where the backward pass reads them: the
    first backward read of a layer's residual runs again the forward ops that remake all
    of that layer's recomputed residuals (`partir.recompute`), from the kept values they
    come from, taken through an `optimization_barrier` together with a backward value so
    that XLA can neither merge the recomputation with the forward pass nor move it
    earlier. The forward residual is then read by nothing after the forward pass, and
    XLA frees it.

    And reads the forward values a relaxed user checkpoint reuses (`Partitioning.reuse`):
    a read of a reused value in the checkpoint's backward region reads its forward rerun
    (in a scan's backward body, its slice of the stack the forward loop makes of it); the
    rerun's own op is then dead, and XLA drops it."""

    def __init__(self, part, hooks):
        prog = self.prog = part.program
        self.hooks = hooks
        self.rec = recompute(prog, part.rematerialized, part.saved)
        self.root = call_roots(prog)
        self.block_of = {self.root[r]: b for b, rs in self.rec.by_layer.items() for r in rs}
        self.residual_of = {self.root[r]: r for rs in self.rec.by_layer.values() for r in rs}
        self.ops = {b.index: [o for o in self.rec.ops if o in set(b.ops)] for b in residual_layers(prog)}
        reads = relaxation(prog, part.reused).reads
        self.reuse = {self.root[w]: v for w, v in reads.items()}
        self.scans = ScanRemat(prog, self.rec, [b for b in residual_layers(prog) if b.loop >= 0 and b.index in self.rec.by_layer],
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
        """The recomputed values of layer `b` (made on its first backward read; in a
        scan's backward body, from that body's slices)."""
        key = (b, self.scans.body_of(rid))
        if key in self.done:
            return self.done[key]
        prog, values = self.prog, self.hooks.values
        sources = sorted({s for r in self.rec.by_layer[b] for s in self.rec.sources[r]})
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
                    local[r] = self.hooks.constrain(self.hooks.order.made(r, x), r)
        self.done[key] = local
        return local


class ScanRemat:
    """Rematerialization across a scan's two loops. The forward loop stacks, for each
    recomputed residual, a scalar instead of the residual (nothing reads it), and stacks
    in addition what recomputing needs that it does not stack already (its layer input,
    say); the backward loop slices those extra stacks, and recomputes the residuals in
    its body from its slices of the kept stacks and of the extra ones."""

    def __init__(self, program, rec, loop_layers, reuse=None):
        self.prog = program
        self.fwd = {b.loop: b for b in loop_layers}  # forward body region -> layer
        reused = {}  # forward body -> the forward values relaxed checkpoints in the backward body read
        for w, v in (reuse or {}).items():
            fwd, bwd = _loop_of(program, v), _loop_of(program, w)
            if fwd >= 0 and bwd >= 0:
                self.fwd.setdefault(fwd, next(b for b in layers_of(program) if b.loop == fwd))
                reused.setdefault(fwd, []).append(v)
        stacked, sliced, self.slice_block, self.slice_residual = {}, {}, {}, {}
        for op in program.ops:
            if op.link and op.primitive == Link.SCAN_YS:
                stacked[op.operands[0]] = op.results[0]
            elif op.link and op.primitive == Link.SCAN_XS:
                sliced[(op.operands[0], program.values[op.results[0]].region)] = op.results[0]
        self.stacked, self.sliced = stacked, sliced
        gone = {r for b in loop_layers for r in rec.by_layer[b.index]}
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
            srcs = sorted({s for r in rec.by_layer.get(b.index, ()) for s in rec.sources[r]})
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
        if body >= 0 and s in self.slices.get(body, {}):
            return self.slices[body][s]
        return values[self.origin(s, body)]

    def origin(self, s: int, body: int) -> int | None:
        """The value whose value `source` reads for source `s` in backward body `body`:
        `s` itself, the backward body's slice of the stack `s` is a slice of, a loop
        constant from outside both loops; None where it is the forward loop's stack of
        it (`slices`)."""
        if body < 0:
            return s
        if s in self.slices.get(body, {}):
            return None
        stack = self.stacked.get(s)
        if stack is not None and (stack, body) in self.sliced:
            return self.sliced[(stack, body)]
        op = self.prog.ops[self.prog.producer[s]] if self.prog.producer[s] >= 0 else None
        if op is not None and op.link and (op.operands[0], body) in self.sliced:
            return self.sliced[(op.operands[0], body)]  # a stacked parameter's slice
        if op is not None and op.link and op.primitive == Link.SCAN_CONST:
            return op.operands[0]  # a loop constant, from outside both loops
        if self.prog.values[s].region != self.bwd.get(body, -2) and self.prog.producer[s] >= 0:
            raise PartitioningError(f"recomputing in scan body #{body} needs {self.prog.name(s)}, which the forward "
                                    "loop neither stacks nor is asked to")
        return s

    def evaluate(self, eqn, children, ins, run, values):
        """The scan `eqn` evaluated with its rematerialization, or None if it has none;
        `run(child, args)` runs its body and records what it defines, by value id, in
        `values` (where the stacks of what recomputing needs are read from)."""
        (child,) = children
        if child in self.fwd and self.fwd[child].index is not None:
            return self._forward(eqn, child, ins, run, values)
        if child in self.bwd:
            return self._backward(eqn, child, ins, run, values)
        return None

    def _forward(self, eqn, child, ins, run, values):
        p = eqn.params
        nk = len(ins.carry)
        region = self.prog.regions[child]
        drop = [k for k, v in enumerate(region.outvars[nk:]) if self.stacked.get(v) in self.placeholders]

        def body(carry, x):
            outs = run(child, [*ins.consts, *carry, *x])
            ys = list(outs[nk:])
            for k in drop:
                ys[k] = jax.numpy.zeros((), ys[k].dtype)
            extra = tuple(values[s] for s in self.extra[child])
            return tuple(outs[:nk]), (tuple(ys), extra)

        carry, (ys, extra) = jax.lax.scan(body, tuple(ins.carry), tuple(ins.xs), length=p["length"],
                                          reverse=p["reverse"], unroll=p["unroll"])
        self.stacks[child] = extra
        return [*carry, *ys]

    def _backward(self, eqn, child, ins, run, values):
        p = eqn.params
        nk, nx = len(ins.carry), len(ins.xs)
        fwd = self.bwd[child]
        more = [(s, stack) for s, stack in self.sliced_sources[fwd] if (stack, child) not in self.sliced]
        extra_stacks = tuple(self.stacks.get(fwd, ())) + tuple(values[stack] for _, stack in more)
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
    return scan_body_of(program, program.values[v].region)


def _loop_input(program, s: int, kinds=(Link.SCAN_CONST, Link.SCAN_XS)) -> bool:
    """Is `s` a scan body's constant or its slice of a stacked input (which the backward
    loop can have too), rather than something the loop makes or carries?"""
    p = program.producer[s]
    return p >= 0 and program.ops[p].link and program.ops[p].primitive in kinds
