"""Evaluating one equation, or a whole jaxpr, as JAX evaluates them: the one way the
lowerings' interpreters bind a primitive."""

from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr, Literal

from .._nested import evaluate_nested, nested_entry, sub_jaxprs

#: Collectives a `shard_map` body traced with `check_vma=True` holds, as the untyped
#: ones the shard_map lowering binds in their place: it runs with `check_vma=False`, where
#: values carry no varying-axes type for the typed forms to check.
_UNTYPED = {
    "pvary": lambda xs, p: list(xs),
    "psum_invariant": lambda xs, p: [jax.lax.psum(xs[0], p["axes"])],
    "all_gather_invariant": lambda xs, p: [jax.lax.all_gather(xs[0], p["axis_name"], axis=p["all_gather_dimension"],
                                                              tiled=p["tiled"])],
}


#: Params through which an equation asks for its result's layout on a mesh (sharding in
#: types: `broadcast_in_dim`'s `sharding`, `dot_general`'s `out_sharding`, ...; JAX writes
#: them around a `shard_map`): the plan's layouts replace them, as they replace the
#: program's `sharding_constraint`s, so they are bound as None (their default).
LAYOUT_PARAMS = ("sharding", "out_sharding")


def bind_equation(eqn, args, **changes) -> list:
    """The results (a list) of equation `eqn` on `args`, its params updated by `changes`
    and its layout requests dropped (`LAYOUT_PARAMS`). A primitive that holds a jaxpr (a
    `shard_map`) takes it as a function, as JAX's own evaluator binds it
    (`get_bind_params`)."""
    params = dict(eqn.params)
    for key in LAYOUT_PARAMS:
        if params.get(key) is not None:
            params[key] = None
    params.update(changes)
    bound = eqn.primitive.get_bind_params(params)
    # Older JAX returns (subfuns, params); 0.10 puts the subfuns among the params.
    subfuns, bound = bound if isinstance(bound, tuple) else ((), bound)
    outs = eqn.primitive.bind(*subfuns, *args, **bound)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def eval_jaxpr(jaxpr, consts, args) -> list:
    """The outputs of `jaxpr` (a `Jaxpr`, or a `ClosedJaxpr` with `consts` None) on
    `args`, equation by equation: a body that runs on one device's blocks (a user's
    `shard_map`), its collectives over the mesh axes of the `shard_map` it runs inside
    (untyped, `_UNTYPED`). Loops, conds and calls in it are traced again around this
    evaluator (`evaluate_nested`), so none of the body's varying-axes types is checked
    where values carry none."""
    if consts is None:
        jaxpr, consts = jaxpr.jaxpr, jaxpr.consts
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(x):
        return x.val if isinstance(x, Literal) else env[x]

    for eqn in jaxpr.eqns:
        args = [read(x) for x in eqn.invars]
        untyped = _UNTYPED.get(eqn.primitive.name)
        if untyped is not None:
            outs = untyped(args, eqn.params)
        elif nested_entry(eqn) is not None:
            children = eqn.params["branches"] if eqn.primitive.name == "cond" else sub_jaxprs(eqn)
            outs = evaluate_nested(eqn, tuple(children), args, _run_child)
        else:
            outs = bind_equation(eqn, args)
        env.update(zip(eqn.outvars, outs))
    return [read(x) for x in jaxpr.outvars]


def _run_child(child, args) -> list:
    return eval_jaxpr(child, None, args) if isinstance(child, ClosedJaxpr) else eval_jaxpr(child, (), args)


def lowering_params(eqn, mesh) -> dict:
    """What changes in `eqn`'s params when the jit lowering binds it on `mesh` (the
    user's devices with Auto axes, `lowering_mesh`): a `shard_map` runs over that mesh,
    as every layout the lowering states does."""
    return {"mesh": mesh} if eqn.primitive.name == "shard_map" else {}
