"""What the lowering backends share: the plan's layouts as `jax.jit`'s shardings, and
the callable they return."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._errors import PartitioningError
from .._mesh import lowering_mesh
from .._partitioning import Partitioning

#: Primitives that only ask for a layout (a user's sharding constraint, a reshard the
#: arguments' shardings made JAX trace): they compute the identity, and the plan's own
#: constraints replace them.
LAYOUT_ONLY = ("sharding_constraint", "reshard", "mesh_cast")


def jit_with_layouts(run, part: Partitioning, mesh, donate_argnums=()) -> "Lowered":
    """`jax.jit(run)` with the plan's input and output layouts as its shardings, over
    `mesh` as the user made it; arguments of other shapes or dtypes are refused when they
    retrace. On a mesh with Explicit axes, `run` (which states its layouts on the same
    axes made Auto, `lowering_mesh`) runs under `jax.sharding.auto_axes`, so the arrays
    it takes and gives back are typed by the user's mesh."""
    prog = part.program

    def checked(*args):
        _check_shapes(prog, jax.tree_util.tree_leaves(args))  # at trace time: no cost per call
        return run(*args)

    def sharding(v: int) -> NamedSharding:
        return NamedSharding(mesh, part.tiling(v).spec() if v >= 0 else PartitionSpec())

    in_sh = jax.tree_util.tree_unflatten(prog.in_tree, [sharding(v) for v in prog.inputs])
    out_sh = jax.tree_util.tree_unflatten(prog.out_tree, [sharding(v) for v in prog.outputs])
    body = checked if lowering_mesh(mesh) is mesh else jax.sharding.auto_axes(checked, out_sharding=out_sh)
    return Lowered(jax.jit(body, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate_argnums), prog)


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
