"""Mesh descriptions: named axes and their sizes, independent of real devices."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from ._errors import PartitioningError

_AXIS_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """A logical device mesh: ordered axis names with sizes.

    It only describes the shape, so a 64x8 mesh can be planned on a laptop; `jax_mesh`
    builds a real `jax.sharding.Mesh` when the plan is run.
    """

    axes: tuple[tuple[str, int], ...]
    _names: tuple = field(init=False, repr=False, compare=False, hash=False)
    _sizes: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        names = [n for n, _ in self.axes]
        if len(set(names)) != len(names):
            raise PartitioningError(f"mesh axis names must be unique, got {names}: rename the repeated axis")
        for name, size in self.axes:
            if not isinstance(name, str) or not _AXIS_RE.match(name):
                raise PartitioningError(
                    f"mesh axis name {name!r} is not an identifier: use letters, digits and '_'"
                )
            if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
                raise PartitioningError(f"mesh axis {name!r} has size {size!r}: sizes are positive integers")
        object.__setattr__(self, "_names", tuple(names))
        object.__setattr__(self, "_sizes", {n: int(s) for n, s in self.axes})

    @classmethod
    def of(cls, **sizes: int) -> "MeshSpec":
        """`MeshSpec.of(data=2, model=4)`; keyword order is the axis order. Sizes must be
        integers (numpy's too): 2.5 or True is refused, not rounded."""
        return cls(tuple((n, int(s) if isinstance(s, (int, np.integer)) and not isinstance(s, bool) else s)
                         for n, s in sizes.items()))

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """Parse `'data=2,model=4'` (the CLI's form)."""
        axes = []
        for part in text.split(","):
            name, eq, size = part.strip().partition("=")
            if not eq or not size.strip().isdigit():
                raise PartitioningError(
                    f"mesh {text!r}: {part.strip()!r} is not NAME=SIZE; write e.g. 'data=2,model=4'"
                )
            axes.append((name.strip(), int(size)))
        return cls(tuple(axes))

    @classmethod
    def from_jax(cls, mesh) -> "MeshSpec":
        """The description of an existing `jax.sharding.Mesh`."""
        return cls(tuple((str(n), int(s)) for n, s in mesh.shape.items()))

    @property
    def names(self) -> tuple[str, ...]:
        """Axis names in mesh order."""
        return self._names

    @property
    def shape(self) -> tuple[int, ...]:
        """Axis sizes in mesh order."""
        return tuple(s for _, s in self.axes)

    @property
    def num_devices(self) -> int:
        """Number of devices the mesh spans."""
        return math.prod(self.shape)

    def size(self, axis: str) -> int:
        """Size of one axis; a clear error for an unknown name."""
        s = self._sizes.get(axis)
        if s is None:
            raise PartitioningError(f"mesh axis {axis!r} is not in the mesh; its axes are {list(self.names)}")
        return s

    def devices_along(self, axes) -> int:
        """The number of devices along `axes` (an iterable of axis names; 1 for none): the
        product of their sizes, i.e. how many blocks a dim split over them has. A clear
        error for an unknown name."""
        k = 1
        for a in axes:
            s = self._sizes.get(a)
            k *= s if s is not None else self.size(a)
        return k

    def sizes(self) -> dict[str, int]:
        """Axis name -> size."""
        return dict(self.axes)

    def jax_mesh(self, devices=None):
        """A `jax.sharding.Mesh` with Auto axes over the first `num_devices` devices."""
        import jax
        from jax.sharding import AxisType, Mesh

        devs = list(jax.devices() if devices is None else devices)
        if len(devs) < self.num_devices:
            raise PartitioningError(
                f"mesh {self} needs {self.num_devices} devices but {len(devs)} are available; "
                "use a smaller mesh or set XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU"
            )
        arr = np.array(devs[: self.num_devices], dtype=object).reshape(self.shape)
        return Mesh(arr, self.names, axis_types=(AxisType.Auto,) * len(self.axes))

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.axes)


def lowering_mesh(mesh):
    """The mesh a plan is lowered on for the user's `mesh`: the same devices and axes,
    every axis Auto (`with_sharding_constraint` refers to Auto axes only; `jax.make_mesh`
    gives Explicit ones). A mesh with Manual axes (the mesh inside a `shard_map`) is a
    `PartitioningError`: automap plans the whole program over the mesh outside it."""
    from jax.sharding import AxisType, Mesh

    types = tuple(getattr(mesh, "axis_types", None) or (AxisType.Auto,) * len(mesh.axis_names))
    manual = [n for n, t in zip(mesh.axis_names, types) if t == AxisType.Manual]
    if manual:
        raise PartitioningError(
            f"mesh axes {manual} are Manual (a mesh inside shard_map): automap plans over Auto or Explicit axes; "
            "pass the mesh the program runs on outside shard_map, e.g. jax.make_mesh(shape, names)")
    if all(t == AxisType.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))

