"""The `jit` lowering backend: the plan as `jax.jit` with its layouts stated.

The backend re-interprets the jaxpr under `jax.jit` with `in_shardings` and
`out_shardings` from the input and output tilings and a `with_sharding_constraint` on
every value the plan fixes; XLA's partitioner then inserts the collectives at the
reshard and reduction points. Constraints never change what is computed, only where,
so the lowered program is equivalent to the original by construction; the tests check
that the interpreter keeps it so (nested jaxprs included).
"""

from __future__ import annotations

import jax
from jax.extend.core import Literal
from jax.sharding import NamedSharding

from .._errors import PartitioningError
from .._mesh import lowering_mesh
from .._nested import evaluate_nested
from .._partitioning import Partitioning
from .._reshard import gathered_first
from .._scans import var_ids
from ._common import LAYOUT_ONLY, jit_with_layouts
from ._eval import bind_equation, lowering_params
from ._hooks import JitHooks
from ._jit_pipeline import JitPipelines, stage_blocks

#: What the `jit` backend constrains: every value ('all'), or only the program's inputs
#: and outputs ('boundary', leaving the interior to XLA's propagation).
CONSTRAIN_MODES = ("all", "boundary")

#: Contractions, whose partitioning XLA may choose along a mesh axis the plan leaves idle.
CONTRACTIONS = ("dot_general", "conv_general_dilated")

def _numeric(dtype) -> bool:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _refuse_rings(part: Partitioning) -> None:
    """XLA's partitioner places collectives from layouts, and no layout makes it rotate
    blocks round a ring (`partir.Partitioning.ring`): a plan with rings is refused."""
    if part.rings:
        names = ", ".join(sorted({axis for _, axis in part.rings.values()}))
        raise PartitioningError(f"the jit lowering cannot run this plan: it moves values round a ring over {names} "
                                "(ContextParallel(strategy='ring')), which XLA's partitioner does not emit from "
                                "layouts; lower it with backend='shard_map' (lowering='shard_map'), or use "
                                "strategy='allgather'")


def lower_jit(part: Partitioning, mesh, *, constrain: str = "all", donate_argnums=()):
    """`jax.jit` with in/out shardings and sharding constraints on the plan's values."""
    if constrain not in CONSTRAIN_MODES:
        raise PartitioningError(f"constrain={constrain!r} is not one of {CONSTRAIN_MODES}")
    _refuse_rings(part)
    prog = part.program
    user_mesh, mesh = mesh, lowering_mesh(mesh)
    shardings: dict[int, NamedSharding] = {}
    blocks = stage_blocks(part)  # held as the stages' blocks, not as the plan lays them out

    def sharding(v: int) -> NamedSharding:
        s = shardings.get(v)
        if s is None:
            s = shardings[v] = NamedSharding(mesh, part.tiling(v).spec())
        return s

    def constrain_value(x, v: int):
        if constrain != "all" or v < 0 or v in blocks:
            return x
        val = prog.values[v]
        if not val.shape or not _numeric(val.dtype) or getattr(x, "ndim", len(val.shape)) != len(val.shape):
            return x  # (a scalar standing for a stack a scan no longer keeps)
        for t in stated_on_the_way(part, v):
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, t.spec()))
        return jax.lax.with_sharding_constraint(x, sharding(v))

    hooks = JitHooks(part, mesh, constrain_value)
    hooks.pipelines = JitPipelines(part, mesh) if part.pipelines else ()

    def run(*args):
        hooks.start()
        leaves = jax.tree_util.tree_leaves(args)
        if hooks.order:  # the inputs in the plan's token order, split as the plan has them
            leaves = [x if y is x else constrain_value(y, v)
                      for x, y, v in zip(leaves, hooks.order.enter(leaves), prog.inputs)]
        outs = hooks.order.leave(_eval_region(prog, 0, leaves, hooks))
        return jax.tree_util.tree_unflatten(prog.out_tree, outs)

    return jit_with_layouts(run, part, user_mesh, donate_argnums)


def _eval_region(prog, rid: int, args, hooks):
    """Interpret region `rid`'s jaxpr on `args`; `hooks` (`_hooks.JitHooks`)
    constrain every value it defines and may replace what an equation reads (a value
    moved for the backward pass, a residual recomputed)."""
    region = prog.regions[rid]
    jaxpr = region.jaxpr
    env, ids = {}, {}
    for var, c in zip(jaxpr.constvars, region.consts):
        env[var] = c
    for v, c in zip(region.constvars, region.consts):
        hooks.record(v, c)  # what a value made from scalars is made again from
    for var, a, v in zip(jaxpr.invars, args, region.invars):
        env[var], ids[var] = (a if rid == 0 else hooks.constrain(a, v)), v
        hooks.record(v, env[var])

    def read(x):
        return x.val if isinstance(x, Literal) else env[x]

    skip = 0  # the equations of a region run per microbatch (`_pipeline_head`) after its first
    for i, eqn in enumerate(jaxpr.eqns):
        if i < skip:
            continue
        end = hooks.pipelines.unit(rid, i) if hooks.pipelines else None
        if end is not None:
            every = var_ids(prog, rid)
            made = hooks.pipelines.run_unit(rid, i, {every[x]: a for x, a in env.items() if x in every})
            for j in range(i, end):  # (its results come out of the region at rest)
                for var, v in zip(jaxpr.eqns[j].outvars, region.eqn_results[j]):
                    if v in made:
                        env[var], ids[var] = made[v], v
                        hooks.record(v, made[v])
            skip = end
            continue
        children = region.children.get(i)
        piped = children is not None and children[0] in hooks.pipelines
        # A pipelined scan reads its stacked operands where their stages hold them.
        invals = [read(x) for x in eqn.invars] if piped else hooks.operands(
            rid, i, eqn, [-1 if isinstance(x, Literal) else ids.get(x, -1) for x in eqn.invars],
            [read(x) for x in eqn.invars])
        oid = region.eqn_ops[i]
        # Keep the equation's name stack (`transpose(jvp(...))` marks the backward pass)
        # in the HLO metadata, so compiled collectives can be traced back to their pass.
        with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
            if piped:
                ins = [-1 if isinstance(x, Literal) else ids[x] for x in eqn.invars]
                outs = hooks.pipelines.run(eqn, children[0], ins, region.eqn_results[i], invals)
            elif children is not None:
                def run(c, a):
                    return _eval_region(prog, c, a, hooks)

                outs = hooks.nested(eqn, children, invals, run)
                if outs is None:
                    outs = evaluate_nested(eqn, children, invals, run)
            elif eqn.primitive.name in LAYOUT_ONLY:
                outs = invals  # the plan decides layouts; the program's own requests give way
            else:
                outs = bind_equation(eqn, invals, **lowering_params(eqn, hooks.mesh))
                hooks.produced(oid, outs)
        for var, o, v in zip(eqn.outvars, outs, region.eqn_results[i]):
            if v >= 0:  # (a pipelined scan's results come out of its region at rest)
                env[var], ids[var] = (o if piped else hooks.constrain(hooks.order.made(v, o), v)), v
                hooks.record(v, env[var])
    return [read(x) for x in jaxpr.outvars]


def stated_on_the_way(part: Partitioning, v: int) -> list:
    """The layouts, in order, that the `jit` lowering states for value `v` between the
    op that makes it and its at-rest layout, so that XLA moves it as the model does:

    - a result made in one layout and kept in another, not partial: the layout it is
      made in (else XLA computes the op in the kept layout and moves its operands there
      its own way: a cut exchanging halos, a matmul gathering one operand where the plan
      moves its result with an all-to-all);
    - a contraction's partial sum kept split along every axis it is summed over (a
      reduce-scatter): the summed layout (else XLA computes the op split along an idle
      axis and permutes the result to the kept layout; a scatter-add's, stated so, would
      have XLA gather its operand instead);
    - a dim traded for fewer blocks: the layout gathered to the axes it keeps (else XLA
      permutes blocks to groups of devices and gathers within them)."""
    prog = part.program
    p = prog.producer[v]
    if p < 0:
        return []
    made, kept = part.produced(v), part.tiling(v)
    out = []
    if not made.partial and made.dims != kept.dims and made.dims == _made_in_blocks(part, p, v):
        out.append(made)
    if made.partial and prog.ops[p].primitive in CONTRACTIONS and _scatters(made, kept):
        out.append(made.without_partial())
    via = gathered_first(made.without_partial(), kept, part.mesh)
    if via is not None:
        out.append(via)
    return out


def _made_in_blocks(part: Partitioning, op: int, v: int) -> tuple:
    """The dims in which op `op` makes `v` as contiguous blocks (`block_layout`): a
    reshape merging `[3, heads, head_dim]` with only the heads split makes no layout of
    the merged dim, and stating one would have XLA gather, slice and gather again."""
    slots = part.block_layout(op)[0]
    return next(dims for side, _, w, dims in slots if side == "result" and w == v)


def _scatters(made, kept) -> bool:
    """Is a value made partial kept split along every axis it is summed over?"""
    split = {a for axes in kept.dims for a in axes}
    return set(made.partial) <= split
