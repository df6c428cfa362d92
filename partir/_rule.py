"""Factor rules: how the dims of an op's operands and results relate.

A rule is data, in the manner of Shardy's `OpShardingRule`: every operand and result
dim is written as a product of *factors* (usually one), and a factor shared by several
values means that splitting it over a mesh axis splits all of them the same way.

- A factor in operands and results is a *pass-through* (or batch) factor.
- A factor only in operands is a *reduction* factor: splitting it leaves each device a
  partial result (of kind `reduce_kind`) that must be reduced over the axis.
- A factor only in results (a broadcast dim, an iota) is free to split.
- A *blocked* factor may never be split: values tiled along it are resharded first
  (sort dims, cumulative dims, the sliced dim of a slice, the layer dim of a scan).

`dot_general` of `[i, k] x [k, j]` prints as `([i, k], [k, j]) -> ([i, j]) reduction={k}`;
a reshape that splits a dim prints as `([i*j, k]) -> ([i, j, k])`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ._tiling import REDUCE_KINDS

DimFactors = tuple[int, ...]
ValueFactors = tuple[DimFactors, ...]
#: Mesh axes per dim of one value (major to minor), as a `Tiling`'s dims.
DimAxes = tuple[tuple[str, ...], ...]


@dataclass(frozen=True, slots=True)
class FixedLayout:
    """The layouts an op computes in whatever the plan (a user's `shard_map`): each
    operand is read, and each result made, split over the axes `ins`/`outs` give per
    dim and whole along every other axis. `mesh` holds the (name, size) of each axis the
    op names, which the plan's mesh must have."""

    ins: tuple[DimAxes, ...]
    outs: tuple[DimAxes, ...]
    mesh: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        def spec(dims: DimAxes) -> str:
            return "P(" + ", ".join("None" if not a else repr(a[0]) if len(a) == 1 else repr(a) for a in dims) + ")"

        return f"({', '.join(map(spec, self.ins))}) -> ({', '.join(map(spec, self.outs))})"


@dataclass(frozen=True, slots=True)
class FactorRule:
    """The factor mapping of one op. Factor `f` has size `sizes[f]` and name `names[f]`;
    `operands[i][d]` lists the factors (major to minor) that make up dim `d` of operand `i`.
    """

    operands: tuple[ValueFactors, ...]
    results: tuple[ValueFactors, ...]
    sizes: tuple[int, ...]
    names: tuple[str, ...]
    reduction: tuple[int, ...] = ()
    blocked: tuple[int, ...] = ()
    reduce_kind: str = "sum"
    fixed: FixedLayout | None = None  # layouts the op computes in, whatever its factors

    @property
    def num_factors(self) -> int:
        """Number of distinct factors."""
        return len(self.sizes)

    def __str__(self) -> str:
        def value(v: ValueFactors) -> str:
            return "[" + ", ".join("*".join(self.names[f] for f in d) if d else "1" for d in v) + "]"

        s = "(" + ", ".join(map(value, self.operands)) + ") -> (" + ", ".join(map(value, self.results)) + ")"
        if self.reduction:
            kind = "" if self.reduce_kind == "sum" else f" {self.reduce_kind}"
            s += f" reduction{kind}={{{', '.join(self.names[f] for f in self.reduction)}}}"
        if self.blocked:
            s += f" blocked={{{', '.join(self.names[f] for f in self.blocked)}}}"
        if self.fixed is not None:
            s += f" fixed={self.fixed}"
        return s


def _dims_of(spec) -> list[list[str]]:
    # "ik" -> [["i"], ["k"]]; ["a*b", "c"] -> [["a", "b"], ["c"]]; a dim "" has no factor.
    return [[p for p in d.split("*") if p] if isinstance(d, str) else list(d) for d in spec]


def factor_rule(
    operands: Sequence,
    results: Sequence,
    in_shapes: Sequence[tuple[int, ...]],
    out_shapes: Sequence[tuple[int, ...]],
    *,
    reduction: str | Sequence[str] = (),
    blocked: str | Sequence[str] = (),
    reduce_kind: str = "sum",
    sizes: dict[str, int] | None = None,
) -> FactorRule:
    """Build a `FactorRule` from einsum-like specs.

    Each value's spec lists its dims; a dim is a factor name or names joined by `*`
    (major first). A plain string is one single-letter factor per dim: `"ik"`.
    Sizes come from the shapes for single-factor dims and from `sizes` for the rest.
    `reduction` and `blocked` name factors (a plain string: one letter each); names that
    no value uses are ignored, so family helpers can pass them unconditionally.
    """
    assert reduce_kind in REDUCE_KINDS, reduce_kind
    known = dict(sizes or {})
    order: list[str] = []
    specs_in = [_dims_of(s) for s in operands]
    specs_out = [_dims_of(s) for s in results]
    for specs, shapes in ((specs_in, in_shapes), (specs_out, out_shapes)):
        assert len(specs) == len(shapes), (specs, shapes)
        for spec, shape in zip(specs, shapes):
            assert len(spec) == len(shape), (spec, shape)
            for dim, n in zip(spec, shape):
                for f in dim:
                    if f not in order:
                        order.append(f)
                if len(dim) == 1:
                    f = dim[0]
                    assert known.setdefault(f, n) == n, f"factor {f}: size {known[f]} vs {n}"
                elif dim:
                    prod = 1
                    for f in dim:
                        prod *= known[f]
                    assert prod == n, f"dim {'*'.join(dim)} of size {n} vs factors {prod}"
    index = {f: i for i, f in enumerate(order)}

    def ids(names) -> tuple[int, ...]:
        return tuple(sorted(index[f] for f in names if f in index))

    return FactorRule(
        operands=tuple(tuple(tuple(index[f] for f in d) for d in s) for s in specs_in),
        results=tuple(tuple(tuple(index[f] for f in d) for d in s) for s in specs_out),
        sizes=tuple(known[f] for f in order),
        names=tuple(order),
        reduction=ids(reduction),
        blocked=ids(blocked),
        reduce_kind=reduce_kind,
    )
