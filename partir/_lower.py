"""Lowering: a partitioned program becomes a callable that runs on a device mesh.

One small interface, `lower(part, mesh, backend=...)`, over a table of backends. The
`jit` backend re-interprets the jaxpr under `jax.jit` with `in_shardings` and
`out_shardings` from the input and output tilings and a `with_sharding_constraint` on
every value the plan fixes; XLA's partitioner then inserts the collectives at the
reshard and reduction points. Constraints never change what is computed, only where,
so the lowered program is equivalent to the original by construction; the tests check
that the interpreter keeps it so (nested jaxprs included).
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.extend.core import Literal
from jax.sharding import NamedSharding, PartitionSpec

from ._errors import PartitioningError
from ._nested import Link, evaluate_nested
from ._partitioning import Partitioning

#: What the `jit` backend constrains: every value ('all'), or only the program's inputs
#: and outputs ('boundary', leaving the interior to XLA's propagation).
CONSTRAIN_MODES = ("all", "boundary")

#: Primitives that only ask for a layout (a user's sharding constraint, a reshard the
#: arguments' shardings made JAX trace): they compute the identity, and the plan's own
#: constraints replace them.
LAYOUT_ONLY = ("sharding_constraint", "reshard", "mesh_cast")

#: Primitives that cut pieces out of a value (along dims their rules block).
CUTS = ("split", "slice")

_BACKENDS: dict[str, Callable] = {}


def register_backend(name: str):
    """Decorator: add a lowering backend `fn(part, jax_mesh, **options) -> callable`."""

    def deco(fn):
        _BACKENDS[name] = fn
        return fn

    return deco


def lower(part: Partitioning, mesh=None, *, backend: str = "jit", **options):
    """Lower a partitioning to a callable taking the original (non-static) arguments.

    `mesh` is a `jax.sharding.Mesh` whose axes match the plan's; by default one is built
    from the first devices. Returns what the backend returns (`jit`: a `jax.jit` object,
    so `.lower(*args).compile()` shows the partitioned HLO).
    """
    if backend not in _BACKENDS:
        raise PartitioningError(f"unknown lowering backend {backend!r}; choose one of {sorted(_BACKENDS)}")
    if mesh is None:
        mesh = part.mesh.jax_mesh()
    elif dict(mesh.shape) != part.mesh.sizes():
        raise PartitioningError(
            f"the plan is for mesh {part.mesh} but the given mesh has axes {dict(mesh.shape)}; "
            "pass a mesh with the same axis names and sizes"
        )
    return _BACKENDS[backend](part, mesh, **options)


def _numeric(dtype) -> bool:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


@register_backend("jit")
def lower_jit(part: Partitioning, mesh, *, constrain: str = "all", donate_argnums=()):
    """`jax.jit` with in/out shardings and sharding constraints on the plan's values."""
    if constrain not in CONSTRAIN_MODES:
        raise PartitioningError(f"constrain={constrain!r} is not one of {CONSTRAIN_MODES}")
    prog = part.program
    shardings: dict[int, NamedSharding] = {}

    def sharding(v: int) -> NamedSharding:
        s = shardings.get(v)
        if s is None:
            s = shardings[v] = NamedSharding(mesh, part.tiling(v).spec())
        return s

    def constrain_value(x, v: int):
        if constrain != "all" or v < 0:
            return x
        val = prog.values[v]
        if not val.shape or not _numeric(val.dtype):
            return x
        p = prog.producer[v]
        if p >= 0 and prog.ops[p].primitive in CUTS:
            made = part.produced(v)
            if not made.partial and made.dims != part.tiling(v).dims:
                # A piece cut whole and kept split: say both, else XLA reshards the
                # operand to the kept layout first and exchanges halos to cut it.
                x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, made.spec()))
        return jax.lax.with_sharding_constraint(x, sharding(v))

    regather = _Reads(part, mesh)

    def hook(x, v: int):
        return constrain_value(x, v)

    hook.regather = regather

    def run(*args):
        regather.clear()
        leaves = jax.tree_util.tree_leaves(args)
        _check_shapes(prog, leaves)  # at trace time: a new shape retraces, and is refused here
        outs = _eval_region(prog, 0, leaves, hook)
        return jax.tree_util.tree_unflatten(prog.out_tree, outs)

    replicated = NamedSharding(mesh, PartitionSpec())
    in_sh = jax.tree_util.tree_unflatten(prog.in_tree, [sharding(v) for v in prog.inputs])
    out_sh = jax.tree_util.tree_unflatten(
        prog.out_tree, [sharding(v) if v >= 0 else replicated for v in prog.outputs])
    return Lowered(jax.jit(run, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate_argnums), prog)


def _check_shapes(prog, leaves) -> None:
    for name, v, x in zip(prog.input_names, prog.inputs, leaves):
        val = prog.values[v]
        if tuple(x.shape) != tuple(val.shape) or x.dtype != val.dtype:
            raise PartitioningError(
                f"argument {name} is {x.dtype}{list(x.shape)}, but the plan was made for {val.dtype}{list(val.shape)}: "
                "plan again for these shapes (automap.jit does so by itself)")


class Lowered:
    """A lowered plan: call it like the original function (its non-static arguments);
    `.lower(*args)` gives JAX's `Lowered` stage (`.compile().as_text()` shows the HLO).
    Arguments are checked against the structure the plan was made for."""

    def __init__(self, jitted, program):
        self.jitted = jitted
        self._in_tree = program.in_tree

    def _check(self, args):
        tree = jax.tree_util.tree_structure(args)
        if tree != self._in_tree:
            raise PartitioningError(
                f"the arguments do not have the structure the plan was made for: expected {self._in_tree}, "
                f"got {tree}; pass the same pytrees (non-static arguments only) as when the program was lifted"
            )

    def __call__(self, *args):
        self._check(args)
        return self.jitted(*args)

    def lower(self, *args):
        """`jax.jit(...).lower(*args)` of the plan."""
        self._check(args)
        return self.jitted.lower(*args)


class _Reads:
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


def _eval_region(prog, rid: int, args, constrain):
    """Interpret region `rid`'s jaxpr on `args`, constraining every value it defines."""
    region = prog.regions[rid]
    jaxpr = region.jaxpr
    env = {}
    for var, c in zip(jaxpr.constvars, region.consts):
        env[var] = c
    for var, a, v in zip(jaxpr.invars, args, region.invars):
        env[var] = a if rid == 0 else constrain(a, v)

    def read(x):
        return x.val if isinstance(x, Literal) else env[x]

    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(x) for x in eqn.invars]
        children = region.children.get(i)
        # Keep the equation's name stack (`transpose(jvp(...))` marks the backward pass)
        # in the HLO metadata, so compiled collectives can be traced back to their pass.
        with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
            if children is not None:
                outs = evaluate_nested(eqn, children, invals, lambda c, a: _eval_region(prog, c, a, constrain))
            elif eqn.primitive.name in LAYOUT_ONLY:
                outs = invals  # the plan decides layouts; the program's own requests give way
            else:
                regather = getattr(constrain, "regather", None)
                if regather is not None and region.eqn_ops[i] >= 0:
                    invals = regather(region.eqn_ops[i], invals, rid)
                outs = eqn.primitive.bind(*invals, **eqn.params)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
                if regather is not None and region.eqn_ops[i] >= 0:
                    regather.produced(region.eqn_ops[i], outs)
        for var, o, v in zip(eqn.outvars, outs, region.eqn_results[i]):
            if v >= 0:
                env[var] = constrain(o, v)
    return [read(x) for x in jaxpr.outvars]
