"""Tilings: how one value is laid out over the mesh."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import PartitioningError

Axes = tuple[str, ...]

#: Reduction kinds a partial value can await; `sum` is the partial sum of a contraction.
REDUCE_KINDS = ("sum", "max", "min", "prod", "and", "or")


@dataclass(frozen=True, slots=True)
class Tiling:
    """The layout of one value: per tensor dim, the mesh axes that split it (major to
    minor), plus the mesh axes over which the value is a partial result awaiting a
    reduction of kind `reduce_kind`.

    Frozen and hashable, so that search states built from tilings are hashable too.
    """

    dims: tuple[Axes, ...]
    partial: Axes = ()
    reduce_kind: str = "sum"

    def __post_init__(self):
        # Only a partial value has a reduction kind: keep equality and hashing exact.
        if not self.partial and self.reduce_kind != "sum":
            object.__setattr__(self, "reduce_kind", "sum")

    @staticmethod
    def replicated(rank: int) -> "Tiling":
        """The fully replicated tiling of a rank-`rank` value."""
        return _REPLICATED[rank] if rank < len(_REPLICATED) else Tiling(((),) * rank)

    @staticmethod
    def from_spec(spec, rank: int) -> "Tiling":
        """Build from a `PartitionSpec` (or tuple of entries) for a rank-`rank` value."""
        entries = tuple(spec)
        if len(entries) > rank:
            raise PartitioningError(f"spec {spec} has {len(entries)} entries for a rank-{rank} value")
        dims = []
        for e in entries + (None,) * (rank - len(entries)):
            dims.append(() if e is None else ((e,) if isinstance(e, str) else tuple(e)))
        return Tiling(tuple(dims))

    @property
    def rank(self) -> int:
        """Number of tensor dims."""
        return len(self.dims)

    @property
    def is_replicated(self) -> bool:
        """True when no dim is split and nothing is partial."""
        return not self.partial and not any(self.dims)

    def axes(self) -> Axes:
        """All axes used by dims, in dim order."""
        return tuple(a for d in self.dims for a in d)

    def without_partial(self) -> "Tiling":
        """The same dims, fully reduced."""
        return Tiling(self.dims) if self.partial else self

    def without_axes(self, axes, partial: bool = False) -> "Tiling":
        """The tiling with mesh `axes` taken off its dims (whole along them), and off
        its partial axes too where `partial` (else its partial state kept)."""
        kept = tuple(a for a in self.partial if a not in axes) if partial else self.partial
        return Tiling(tuple(tuple(a for a in d if a not in axes) for d in self.dims), kept, self.reduce_kind)

    def spec(self):
        """The `jax.sharding.PartitionSpec` of the dims (partial state is not expressible)."""
        from jax.sharding import PartitionSpec

        return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else d for d in self.dims))

    def to_json(self) -> list:
        """The dims as JSON (a plan file's form): per dim None, an axis name, or a list
        of axis names (major to minor). The partial state is not part of it."""
        return [None if not d else d[0] if len(d) == 1 else list(d) for d in self.dims]

    @staticmethod
    def from_json(data) -> "Tiling":
        """The inverse of `to_json`."""
        if not isinstance(data, list) or not all(e is None or isinstance(e, (str, list)) for e in data):
            raise PartitioningError(f"{data!r} is not a tiling: write one entry per dim, each None, an axis "
                                    "name or a list of axis names")
        return Tiling(tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in data))

    def shard_shape(self, shape: tuple[int, ...], mesh) -> tuple[int, ...]:
        """The per-device block shape of a value of `shape` on `mesh` (a `MeshSpec`)."""
        return tuple(n // mesh.devices_along(d) for n, d in zip(shape, self.dims))

    def num_shards(self, mesh) -> int:
        """How many distinct blocks the dims split the value into on `mesh` (a `MeshSpec`)."""
        return mesh.devices_along(self.axes())

    def __str__(self) -> str:
        parts = []
        for d in self.dims:
            parts.append("None" if not d else repr(d[0]) if len(d) == 1 else "(" + ", ".join(map(repr, d)) + ")")
        s = "P(" + ", ".join(parts) + ")"
        if self.partial:
            kind = "" if self.reduce_kind == "sum" else f"-{self.reduce_kind}"
            s += f" partial{kind}{{{', '.join(self.partial)}}}"
        return s


_REPLICATED = tuple(Tiling(((),) * r) for r in range(9))
