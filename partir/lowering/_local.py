"""One op computed on the blocks a device holds, inside `jax.shard_map`.

Most primitives compute blocks of their results from blocks of their operands as they
are (elementwise ops, `dot_general`, transposes, reductions, convolutions over split
batch or feature dims, ...): their partial results are completed after the op. The
others hold shapes or positions in their params; each has a local rule here, in one
table keyed by primitive (as JAX keeps its rules): per-device shapes for
`broadcast_in_dim`, `reshape`, `iota` (plus the block's offset along a split iota dim),
`slice`, `dynamic_slice`; the vocabulary-parallel lookup for `gather` and `scatter`
(indices shifted by the block's offset, rows held elsewhere read as zeros or dropped);
random bits drawn whole along their generated dims and sliced, so every layout draws
the same numbers. A primitive without a rule whose results come out with other than
the per-device shapes raises a `PartitioningError` naming it: it is never guessed.

A result partial over mesh axes is the sum (or max, ...) of the devices' results along
them, which is right only for operands split along those axes (they hold the split
reduction factor). An operand whole along them is read on every one of those devices:
right where the op does not sum it (a gather's indices, a dot's scales), wrong where it
does (a scatter-add's operand would be added once per device, so its rule adds it on
the first device only). Any other such operand raises a `PartitioningError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.lax import GatherScatterMode

from .._errors import PartitioningError
from .._mesh import MeshSpec
from .._tiling import Tiling
from ._eval import bind_equation, eval_jaxpr
from ._spmd import block_index, move


@dataclass(frozen=True)
class LocalOp:
    """An op as one device computes it: its equation, the layout it reads each operand in
    (`ins`, None for a literal) and makes each result in (`outs`, without the partial
    state), the global shapes, and the mesh."""

    eqn: object
    ins: tuple
    outs: tuple
    in_shapes: tuple
    out_shapes: tuple
    mesh: MeshSpec
    partial: tuple[str, ...] = ()  # the mesh axes the results are partial over

    def local_out(self, k: int) -> tuple[int, ...]:
        """Per-device shape of result `k`."""
        return self.outs[k].shard_shape(self.out_shapes[k], self.mesh)

    def split(self) -> bool:
        """Does any of the op's values have a split dim?"""
        return any(t is not None and t.axes() for t in self.ins + self.outs)

    def whole_along_partial(self, k: int) -> tuple[str, ...]:
        """The axes (of more than one device) the results are partial over that operand
        `k` is not split along: each of their devices reads the same block of it."""
        split = self.ins[k].axes() if self.ins[k] is not None else ()
        return tuple(a for a in self.partial if a not in split and self.mesh.size(a) > 1)

    def offset(self, k: int, d: int):
        """Where this device's block of dim `d` of operand `k` starts (a traced scalar)."""
        axes = self.ins[k].dims[d]
        return block_index(axes, self.mesh) * (self.in_shapes[k][d] // self.mesh.devices_along(axes))


LocalRule = Callable[[LocalOp, list], list]
_RULES: dict[str, LocalRule] = {}
#: Primitives whose local rule runs even when no value of the op is split (their params
#: describe the whole mesh, which binding them on blocks would misread).
_ALWAYS: set[str] = set()


def local_rule(*names: str, always: bool = False):
    """Decorator: `fn(op: LocalOp, operands) -> results` computes primitives `names` on
    one device's blocks (`always`: even when none of the op's values is split)."""

    def deco(fn: LocalRule) -> LocalRule:
        for name in names:
            _RULES[name] = fn
            if always:
                _ALWAYS.add(name)
        return fn

    return deco


def bind_local(op: LocalOp, operands: list) -> list:
    """The results of `op` on one device's blocks of its operands (in `op.ins` layouts)."""
    eqn = op.eqn
    name = eqn.primitive.name
    _check_partial(op)
    rule = _RULES.get(name)
    if rule is None or not (op.split() or name in _ALWAYS):
        try:
            outs = bind_equation(eqn, operands)
        except (TypeError, ValueError) as e:
            raise _no_rule(name, f"it fails on the blocks ({type(e).__name__}: {e})") from None
    else:
        outs = rule(op, operands)
    for k, out in enumerate(outs):
        if op.outs[k] is not None and tuple(jnp.shape(out)) != op.local_out(k):
            raise _no_rule(name, f"result {k} comes out {tuple(jnp.shape(out))}, the block is {op.local_out(k)}")
    return outs


#: Operands an op may read whole along the axes its results are partial over (see the
#: module docstring): the op does not sum them (indices, group sizes, scales), or its
#: local rule counts them once (a scatter-add's operand).
_WHOLE_ALONG_PARTIAL = {
    "gather": {1},  # the indices
    "ragged_dot_general": {2},  # the group sizes
    "scaled_dot": {2, 3},  # the scales, whole along a split minor factor of their blocks
    "scatter-add": {0},  # the operand, masked to one device by `_scatter`
    "scatter_add": {0},
}


def _check_partial(op: LocalOp) -> None:
    name = op.eqn.primitive.name
    for k in range(len(op.ins)):
        axes = op.whole_along_partial(k)
        if axes and k not in _WHOLE_ALONG_PARTIAL.get(name, ()):
            raise PartitioningError(
                f"primitive {name!r} cannot run on blocks under the shard_map lowering: its results are partial "
                f"over {axes}, along which operand {k} is not split, so each device there would count it again. "
                "Keep the op's reduced dims whole along those axes (pin its values) or use lowering='jit'")


def _no_rule(name: str, why: str) -> PartitioningError:
    return PartitioningError(
        f"primitive {name!r} cannot run on split blocks under the shard_map lowering: {why}. Its params "
        "hold shapes or positions and it has no local rule; register one with partir.lowering._local.local_rule, "
        "or keep its dims whole (pin its values) or use lowering='jit'")


# -- shapes ------------------------------------------------------------------------------


@local_rule("shard_map", always=True)
def _by_hand(op: LocalOp, operands: list) -> list:
    """A region the user partitioned by hand: its body, written for one device's blocks,
    runs on them (read in the layouts its specs fix, `FixedLayout`), its collectives
    over the axes of the `shard_map` this interpreter runs in (the same mesh)."""
    return eval_jaxpr(op.eqn.params["jaxpr"], (), operands)


@local_rule("debug_callback", "debug_print", always=True)
def _once(op: LocalOp, operands: list) -> list:
    """A debug callback (`jax.debug.callback`, `jax.debug.print`) runs once per call, as
    under `jax.jit`: on the mesh's first device, with the whole values (its rule blocks
    every dim, so they are gathered first). It makes no result."""
    first = jax.lax.axis_index(op.mesh.names) == 0

    def run(*xs):
        bind_equation(op.eqn, list(xs))

    jax.lax.cond(first, run, lambda *xs: None, *operands)
    return []


@local_rule("broadcast_in_dim")
def _broadcast(op: LocalOp, operands: list) -> list:
    return bind_equation(op.eqn, operands, shape=op.local_out(0))


@local_rule("reshape")
def _reshape(op: LocalOp, operands: list) -> list:
    return bind_equation(op.eqn, operands, new_sizes=op.local_out(0))


@local_rule("empty", "empty2")
def _empty(op: LocalOp, operands: list) -> list:
    return [jnp.zeros(op.local_out(0), op.eqn.outvars[0].aval.dtype)]


@local_rule("iota")
def _iota(op: LocalOp, operands: list) -> list:
    p = op.eqn.params
    (out,) = bind_equation(op.eqn, operands, shape=op.local_out(0))
    axes = op.outs[0].dims[p["dimension"]]
    if not axes:
        return [out]
    start = block_index(axes, op.mesh) * op.local_out(0)[p["dimension"]]
    return [out + start.astype(out.dtype)]


@local_rule("slice")
def _slice(op: LocalOp, operands: list) -> list:
    # Split dims are taken whole (the rule blocks the sliced ones): all of the block.
    p = op.eqn.params
    local = op.ins[0].shard_shape(op.in_shapes[0], op.mesh)
    split = [bool(a) for a in op.ins[0].dims]
    start = tuple(0 if s else b for s, b in zip(split, p["start_indices"]))
    limit = tuple(n if s else b for s, n, b in zip(split, local, p["limit_indices"]))
    return bind_equation(op.eqn, operands, start_indices=start, limit_indices=limit)


@local_rule("dynamic_slice")
def _dynamic_slice(op: LocalOp, operands: list) -> list:
    local = op.ins[0].shard_shape(op.in_shapes[0], op.mesh)
    sizes = tuple(n if a else s for a, n, s in zip(op.ins[0].dims, local, op.eqn.params["slice_sizes"]))
    return bind_equation(op.eqn, operands, slice_sizes=sizes)


# -- random bits -------------------------------------------------------------------------


@local_rule("random_bits", "random_split")
def _random(op: LocalOp, operands: list) -> list:
    # Drawn whole along the generated dims (the key dims lead and pass through), then
    # sliced: each device keeps its block of the very numbers a whole draw gives.
    (out,) = bind_equation(op.eqn, operands)
    rank = len(op.in_shapes[0])
    drawn = Tiling(op.outs[0].dims[:rank] + ((),) * (len(op.out_shapes[0]) - rank))
    return [move(out, drawn, op.outs[0], op.mesh)]


# -- gathers and scatters ----------------------------------------------------------------


def _local_indices(op: LocalOp, idx, index_map, windows, clamp: bool):
    """Indices into the operand's block: clamped against the whole operand where the op
    clamps them (`clamp`), then shifted by the block's offset along each split dim
    looked up one row at a time (those rows held elsewhere fall out of bounds). Returns
    the indices and the mesh axes of the shifted dims (none: the indices are as given)."""
    shape, split = op.in_shapes[0], op.ins[0].dims
    rows = [k for k, d in enumerate(index_map) if split[d] and windows[d] != shape[d]]
    if not rows:
        return idx, ()
    if clamp:
        hi = np.array([shape[d] - windows[d] for d in index_map], dtype=idx.dtype)
        idx = jnp.clip(idx, 0, hi)
    offsets = [op.offset(0, index_map[k]) if k in rows else jnp.int32(0) for k in range(len(index_map))]
    return idx - jnp.stack(offsets).astype(idx.dtype), tuple(a for k in rows for a in split[index_map[k]])


@local_rule("gather")
def _gather(op: LocalOp, operands: list) -> list:
    p = op.eqn.params
    dn, shape = p["dimension_numbers"], op.in_shapes[0]
    local = op.ins[0].shard_shape(shape, op.mesh)
    sizes = tuple(n if a and s == m else s for a, n, s, m in zip(op.ins[0].dims, local, p["slice_sizes"], shape))
    operand, idx = operands
    # XLA's gather clamps its start indices into the operand: JAX's CLIP, and what its
    # PROMISE_IN_BOUNDS (numpy indexing's mode) does with an index out of bounds.
    clamp = p["mode"] in (GatherScatterMode.CLIP, GatherScatterMode.PROMISE_IN_BOUNDS)
    moved, axes = _local_indices(op, idx, dn.start_index_map, p["slice_sizes"], clamp)
    if not axes:
        return bind_equation(op.eqn, [operand, idx], slice_sizes=sizes)
    (out,) = bind_equation(op.eqn, [operand, moved], slice_sizes=sizes, mode=GatherScatterMode.FILL_OR_DROP, fill_value=0)
    if p["mode"] == GatherScatterMode.FILL_OR_DROP:
        out = _refill(op, out, idx, p, axes)
    return [out]


def _refill(op: LocalOp, out, idx, p, axes):
    """Rows out of bounds of the whole operand read the op's fill value: once, on the
    first device of the split, as the partial sums then add it once."""
    dn, shape = p["dimension_numbers"], op.in_shapes[0]
    hi = np.array([shape[d] - p["slice_sizes"][d] for d in dn.start_index_map], dtype=idx.dtype)
    outside = ~jnp.all((idx >= 0) & (idx <= hi), axis=-1)
    batch = tuple(r for r in range(out.ndim) if r not in dn.offset_dims)
    outside = jax.lax.broadcast_in_dim(outside, out.shape, batch)
    first = block_index(axes, op.mesh) == 0
    return jnp.where(outside & first, _fill(p.get("fill_value"), out.dtype), out)


def _fill(value, dtype):
    """A gather's fill value as JAX defaults it."""
    if value is not None:
        return jnp.asarray(value, dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.bool_):
        return jnp.asarray(True)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if jnp.issubdtype(dtype, jnp.signedinteger) else info.max, dtype)


@local_rule("scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
            "scatter-max", "scatter_max", "scatter_apply")
def _scatter(op: LocalOp, operands: list) -> list:
    p = op.eqn.params
    dn = p["dimension_numbers"]
    shape, upd_shape = op.in_shapes[0], op.in_shapes[2]
    window = [d for d in range(len(shape)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    windows = [1] * len(shape)
    for d, u in zip(window, dn.update_window_dims):
        windows[d] = upd_shape[u]
    operand, idx, *rest = operands
    once = op.whole_along_partial(0)  # an additive scatter's partial sums: add the operand on one device
    if once:
        operand = jnp.where(block_index(once, op.mesh) == 0, operand, jnp.zeros_like(operand))
    # XLA's scatter skips an update out of bounds: JAX's PROMISE_IN_BOUNDS drops it too.
    moved, axes = _local_indices(op, idx, dn.scatter_dims_to_operand_dims, windows,
                                 p["mode"] == GatherScatterMode.CLIP)
    if not axes:
        return bind_equation(op.eqn, [operand, idx, *rest])
    # Updates for rows held elsewhere fall out of the block's bounds and are dropped
    # (indices out of bounds of the whole operand fall out of every block).
    return bind_equation(op.eqn, [operand, moved, *rest], mode=GatherScatterMode.FILL_OR_DROP)
