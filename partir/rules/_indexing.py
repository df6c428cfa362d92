"""Gathers and scatters (embedding lookups, take_along_axis, their gradients)."""

from __future__ import annotations

from .._rule import factor_rule
from ._registry import Namer, register
from ._traits import Traits, Work

#: Scatters whose combiner is a sum: scattering from split updates leaves partial sums.
ADDITIVE_SCATTERS = ["scatter-add", "scatter_add"]
OTHER_SCATTERS = ["scatter", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
                  "scatter-max", "scatter_max", "scatter_apply"]

#: A scatter that combines (one flop per update element) or only writes.
_COMBINING = Traits(Work.SCATTER, indexed=True)
SCATTER_TRAITS = {**{p: _COMBINING for p in ADDITIVE_SCATTERS + OTHER_SCATTERS},
                  "scatter": Traits(Work.MOVE, indexed=True), "scatter_apply": Traits(Work.MOVE, indexed=True)}


#: Gather modes under which a start index into a dim taken whole can only be 0.
_CLAMPED = ("CLIP", "PROMISE_IN_BOUNDS")


@register("gather", traits=Traits(Work.MOVE, indexed=True))
def gather(in_shapes, out_shapes, params):
    """Index dims of the indices pass to the result's batch dims, whole slice dims of the
    operand pass to its offset dims, batching dims are shared by all three. An indexed
    operand dim gathered one row at a time (collapsed, or kept as a size-1 offset dim as
    an indexing under `vmap` does) is a reduction: each device looks up the rows it
    holds (zeros elsewhere) and the partial results are summed; this is the
    vocab-parallel embedding. An embedding lookup is `([i, j], [k, l, m]) -> ([k, l, j]) reduction={i} blocked={m}`."""
    dn = params["dimension_numbers"]
    slice_sizes = params["slice_sizes"]
    clamped = getattr(params.get("mode"), "name", "") in _CLAMPED
    (op_shape, idx_shape), (out_shape,) = in_shapes, out_shapes
    name = Namer()
    op = [name(("op", d)) for d in range(len(op_shape))]
    idx = [name(("idx", d)) for d in range(len(idx_shape))]
    out = [None] * len(out_shape)
    blocked = [idx[-1]] if idx_shape else []
    reduction = []
    for o, i in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        op[o] = idx[i]

    def row_lookup(d):  # one row of an indexed dim: split, it leaves partial sums
        return d in dn.start_index_map and slice_sizes[d] == 1 and op_shape[d] > 1

    window = [d for d in range(len(op_shape)) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for d, r in zip(window, dn.offset_dims):
        whole = slice_sizes[d] == op_shape[d] and (d not in dn.start_index_map or clamped)
        out[r] = op[d] if whole else name(("out", r))
        if row_lookup(d):
            reduction.append(op[d])
        elif not whole:
            blocked += [op[d], out[r]]
    batch_out = [r for r in range(len(out_shape)) if r not in dn.offset_dims]
    for r, i in zip(batch_out, range(len(idx_shape) - 1)):
        out[r] = idx[i]
    out = [f if f is not None else name(("out", r)) for r, f in enumerate(out)]
    for d in dn.collapsed_slice_dims:
        if row_lookup(d):
            reduction.append(op[d])
        elif op_shape[d] > 1:
            blocked.append(op[d])
    return factor_rule([op, idx], [out], in_shapes, out_shapes, reduction=reduction, blocked=blocked)


def _scatter(in_shapes, out_shapes, params, *, additive: bool):
    dn = params["dimension_numbers"]
    op_shape, idx_shape, upd_shape = in_shapes[:3]
    name = Namer()
    op = [name(("op", d)) for d in range(len(op_shape))]
    idx = [name(("idx", d)) for d in range(len(idx_shape))]
    upd = [name(("upd", d)) for d in range(len(upd_shape))]
    blocked = [idx[-1]] if idx_shape else []
    for o, i in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
        op[o] = idx[i]
    window = [d for d in range(len(op_shape)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    clamped = getattr(params.get("mode"), "name", "") in _CLAMPED
    indexed = dn.scatter_dims_to_operand_dims
    for d, u in zip(window, dn.update_window_dims):
        if upd_shape[u] == op_shape[d] and (d not in indexed or clamped):
            upd[u] = op[d]
        elif not (d in indexed and upd_shape[u] == 1):  # one row per index: as an inserted dim
            blocked += [op[d], upd[u]]
    scatter_dims = [u for u in range(len(upd_shape)) if u not in dn.update_window_dims]
    for u, i in zip(scatter_dims, range(len(idx_shape) - 1)):
        upd[u] = idx[i]
    batched = set(dn.scatter_indices_batching_dims)
    spread = [idx[i] for i in range(len(idx_shape) - 1) if i not in batched]
    extra = [[name(("x", k, d)) for d in range(len(s))] for k, s in enumerate(in_shapes[3:])]
    kw = dict(reduction=spread) if additive else dict(blocked=blocked + spread)
    if additive:
        kw["blocked"] = blocked
    return factor_rule([op, idx, upd, *extra], [op] * len(out_shapes), in_shapes, out_shapes, **kw)


@register(*ADDITIVE_SCATTERS, traits=SCATTER_TRAITS)
def scatter_add(in_shapes, out_shapes, params):
    """The operand and result share every dim; update window dims pass through; the
    scattered (index) dims of updates and indices are reductions: split updates
    scatter-add into partial sums. An embedding gradient is
    `([i, j], [k, l, m], [k, l, j]) -> ([i, j]) reduction={k, l} blocked={m}`."""
    return _scatter(in_shapes, out_shapes, params, additive=True)


@register(*OTHER_SCATTERS, traits=SCATTER_TRAITS)
def scatter(in_shapes, out_shapes, params):
    """Like scatter-add, but a non-additive combine cannot merge partial results, so the
    scattered dims are blocked."""
    return _scatter(in_shapes, out_shapes, params, additive=False)
