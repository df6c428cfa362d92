"""`lift`: trace a function to a jaxpr and build the partitioning IR from it."""

from __future__ import annotations

import inspect
import warnings

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from ._errors import UnknownPrimitiveWarning
from ._ir import Op, Origin, Program, Region, Value, no_gc
from ._nested import Link, nested_entry, split_operands
from ._rule import FactorRule, factor_rule
from .rules import Namer, conservative_rule, get_rule


def lift(fn, *args, static_argnums: tuple[int, ...] | int = ()) -> Program:
    """Trace `fn(*args)` and lift its jaxpr into a `Program`.

    `args` may be arrays or `jax.ShapeDtypeStruct`s (nothing is allocated). Inputs are
    named by pytree path under their parameter name (`params['layers'][3]['mlp']['w1']`),
    outputs as `out...`, intermediates by primitive and source line.
    """
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    with no_gc():
        closed, out_shape = jax.make_jaxpr(fn, static_argnums=static, return_shape=True)(*args)
    dyn = tuple(a for i, a in enumerate(args) if i not in static)
    arg_names = _arg_names(fn, len(args))
    dyn_names = [n for i, n in enumerate(arg_names) if i not in static]
    leaves, in_tree = jax.tree_util.tree_flatten_with_path(dyn)
    input_names = [dyn_names[p[0].idx] + jax.tree_util.keystr(p[1:]) for p, _ in leaves]
    input_args = [p[0].idx for p, _ in leaves]
    out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    output_names = ["out" + jax.tree_util.keystr(p) for p, _ in out_leaves]
    origin = Origin(fn, tuple(a if i in static else _abstract(a) for i, a in enumerate(args)), static)
    with no_gc():
        return _build(closed, in_tree, out_tree, input_names, input_args, output_names, origin)


def _abstract(tree):
    def leaf(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    return jax.tree.map(leaf, tree)


def _build(closed, in_tree, out_tree, input_names, input_args, output_names, origin, rolled=(),
           var_names=None) -> Program:
    """The `Program` of `closed`; `var_names` names the values of some of its variables."""
    b = _Builder(var_names)
    top = b.region("top", -1, closed.jaxpr, closed.consts)
    env = {}
    constvars = [b.value(v.aval, top, f"const[{i}]") for i, v in enumerate(closed.jaxpr.constvars)]
    invars = [b.value(v.aval, top, n) for v, n in zip(closed.jaxpr.invars, input_names)]
    env.update(zip(closed.jaxpr.constvars, constvars))
    env.update(zip(closed.jaxpr.invars, invars))
    outvars = b.body(top, closed.jaxpr, env)
    top_region = b.regions[top]
    top_region.constvars, top_region.invars, top_region.outvars = tuple(constvars), tuple(invars), tuple(outvars)
    for o, n in zip(outvars, output_names):
        if o >= 0 and o not in b.names:
            b.names[o] = n
    prog = Program(values=b.values, ops=b.ops, regions=b.regions, inputs=invars, outputs=outvars,
                   in_tree=in_tree, out_tree=out_tree, input_names=input_names, input_args=input_args,
                   output_names=output_names, closed_jaxpr=closed, fallbacks=sorted(b.fallbacks),
                   value_names=b.names, origin=origin, rolled=rolled)
    prog.classes  # part of building the IR: every partitioning needs them
    return prog


def _arg_names(fn, n: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n):
        p = params[i] if i < len(params) else None
        ok = p is not None and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        names.append(p.name if ok else f"args[{i}]")
    return names


class _Builder:
    def __init__(self, var_names=None):
        self.values: list[Value] = []
        self.ops: list[Op] = []
        self.regions: list[Region] = []
        self.names: dict[int, str] = {}
        self.fallbacks: set[str] = set()
        self._rule_cache: dict = {}
        self._var_names: dict = var_names or {}

    # -- construction helpers ---------------------------------------------------------
    def region(self, kind, parent, jaxpr, consts=(), trip_count=1) -> int:
        self.regions.append(Region(len(self.regions), kind, parent, jaxpr, tuple(consts), trip_count=trip_count))
        return len(self.regions) - 1

    def value(self, aval, region, name=None) -> int:
        vid = len(self.values)
        # A token (of ordered effects) has no shape and carries no data: a scalar of
        # JAX's zero-size dtype.
        shape, dtype = (tuple(aval.shape), aval.dtype) if hasattr(aval, "shape") else ((), jax.dtypes.float0)
        self.values.append(Value(vid, shape, dtype, region))
        if name is not None:
            self.names[vid] = name
        return vid

    def op(self, prim, operands, results, rule, region, link, eqn=None) -> int:
        oid = len(self.ops)
        self.ops.append(Op(oid, prim, tuple(operands), tuple(results), rule, region, link, eqn))
        return oid

    def links(self, kind: Link, srcs, dsts, region, *, blocked_lead=0):
        """A link `kind` from each of `srcs` to the matching one of `dsts` (see `link`)."""
        for src, dst in zip(srcs, dsts):
            self.link(kind, src, dst, region, blocked_lead=blocked_lead)

    def link(self, kind: Link, src, dst, region, *, blocked_lead=0):
        """An identity link src -> dst, run once per run of `region`; `blocked_lead` leading
        dims of src (the stacked layer dim of a scan's xs) or of dst (of its ys, when
        negative) exist on one side only and are blocked."""
        if src < 0 or dst < 0:
            return
        a, b = self.values[src].shape, self.values[dst].shape
        name = Namer()
        if blocked_lead > 0:
            lead = [name(("L", d)) for d in range(blocked_lead)]
            rule = factor_rule([lead + [name(d) for d in range(len(b))]], [[name(d) for d in range(len(b))]], [a], [b], blocked=lead)
        elif blocked_lead < 0:
            lead = [name(("L", d)) for d in range(-blocked_lead)]
            rule = factor_rule([[name(d) for d in range(len(a))]], [lead + [name(d) for d in range(len(a))]], [a], [b], blocked=lead)
        else:
            dims = [name(d) for d in range(len(a))]
            rule = factor_rule([dims], [dims], [a], [b])
        self.op(str(kind), (src,), (dst,), rule, region, True)

    def rule(self, eqn, in_shapes, out_shapes) -> FactorRule:
        prim = eqn.primitive.name
        try:
            key = (prim, in_shapes, out_shapes, tuple(eqn.params.items()))
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in self._rule_cache:
            return self._rule_cache[key]
        fn = get_rule(prim)
        problem = None
        if fn is not None:
            try:
                rule = fn(in_shapes, out_shapes, eqn.params)
            except Exception as e:  # a rule that cannot describe these params: stay safe
                problem = f"its rule failed on these params ({type(e).__name__}: {e})"
        else:
            problem = "it has no partitioning rule"
        if problem is not None:
            rule = conservative_rule(in_shapes, out_shapes)
            if prim not in self.fallbacks:
                self.fallbacks.add(prim)
                warnings.warn(
                    f"automap: primitive '{prim}' is treated as replicated because {problem}; "
                    "the plan stays correct but may gather its operands. Register a rule with "
                    "partir.rules.register to partition it.",
                    UnknownPrimitiveWarning,
                    stacklevel=4,
                )
        if key is not None:
            self._rule_cache[key] = rule
        return rule

    # -- the walk -----------------------------------------------------------------------
    def body(self, rid, jaxpr: Jaxpr, env) -> list[int]:
        region = self.regions[rid]
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [-1 if isinstance(v, Literal) else env[v] for v in eqn.invars]
            outs = [self.value(v.aval, rid, self._var_names.get(v)) if not _dropped(v) else -1 for v in eqn.outvars]
            for v, o in zip(eqn.outvars, outs):
                if o >= 0:
                    env[v] = o
            region.eqn_results.append(tuple(outs))
            nested = nested_entry(eqn)
            if nested is not None:
                region.children[i] = nested.lift(self, rid, eqn, split_operands(eqn, ins), outs)
                region.eqn_ops.append(-1)
                continue
            in_shapes = tuple(tuple(getattr(v.aval, "shape", ())) for v in eqn.invars)
            out_shapes = tuple(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
            rule = self.rule(eqn, in_shapes, out_shapes)
            region.eqn_ops.append(self.op(eqn.primitive.name, ins, outs, rule, rid, False, eqn))
        return [-1 if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]

    def sub(self, kind, parent, closed, *, trip_count=1, enter=None):
        """Lift `closed` (Jaxpr or ClosedJaxpr) as a child region of `parent`.

        `enter(invars)` runs after the region's invars exist and before its body is
        lifted, to link outer values in: op order then follows execution order (in-links,
        body, out-links), which liveness relies on. Returns (rid, invars, outvars)."""
        jaxpr, consts = (closed.jaxpr, closed.consts) if isinstance(closed, ClosedJaxpr) else (closed, ())
        rid = self.region(kind, parent, jaxpr, consts, trip_count)
        env = {}
        cvs = [self.value(v.aval, rid, f"{kind}#{rid}.const[{k}]") for k, v in enumerate(jaxpr.constvars)]
        ivs = [self.value(v.aval, rid, f"{kind}#{rid}.in[{k}]") for k, v in enumerate(jaxpr.invars)]
        env.update(zip(jaxpr.constvars, cvs))
        env.update(zip(jaxpr.invars, ivs))
        if enter is not None:
            enter(ivs)
        ovs = self.body(rid, jaxpr, env)
        r = self.regions[rid]
        r.constvars, r.invars, r.outvars = tuple(cvs), tuple(ivs), tuple(ovs)
        return rid, ivs, ovs


def _dropped(v) -> bool:
    return type(v).__name__ == "DropVar"
