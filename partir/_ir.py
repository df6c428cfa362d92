"""The partitioning IR: values, ops and regions lifted from a jaxpr.

A `Program` is a flat graph over every value of the jaxpr and of its nested jaxprs.
Nested jaxprs (`jit`, `remat2`, custom derivatives, `scan`, `while`, `cond`) become
`Region`s; their boundaries are *link* ops, identity factor rules that tie an outer
value to the inner value it becomes (an argument entering a call, a loop carry going
round, a stacked `[L, ...]` parameter sliced per iteration with its `L` dim blocked).
So one generic propagator moves tilings into and out of bodies, and a carry keeps one
tiling across iterations. How each nested primitive is lifted and evaluated is kept
together in `partir._nested`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ._errors import PartitioningError
from ._graph import made_from_scalars
from ._rule import FactorRule
from .rules import get_traits


class Value(NamedTuple):
    """One array value of the program (per call site: a function called twice has two).
    Immutable; a named tuple because programs hold tens of thousands of them."""

    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    region: int

    @property
    def rank(self) -> int:
        """Number of dims."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unpartitioned) value."""
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys): count their raw words
        return getattr(dtype, "itemsize", 8)


class Op(NamedTuple):
    """One op: a primitive application, or a link across a region boundary. Immutable.

    `operands`/`results` hold value ids (-1 for a literal operand or a dropped result).
    """

    id: int
    primitive: str
    operands: tuple[int, ...]
    results: tuple[int, ...]
    rule: FactorRule
    region: int
    link: bool
    eqn: Any = None


class Origin(NamedTuple):
    """What a program was lifted from: the function, its arguments (abstract, so no
    array is kept alive) and the static argument positions. The search traces shallow
    twins of deep models from it (`search._twins`)."""

    fn: object
    args: tuple
    static_argnums: tuple[int, ...]


@dataclass(eq=False)
class Region:
    """A jaxpr body: the top level, or one call site of a nested jaxpr.

    `trip_count` is how many times the body runs per run of its parent (a scan's
    length; None for a `while`, whose count is unknown; 1 otherwise)."""

    id: int
    kind: str
    parent: int
    jaxpr: Any
    consts: tuple = ()
    constvars: tuple[int, ...] = ()
    invars: tuple[int, ...] = ()
    outvars: tuple[int, ...] = ()
    eqn_results: list = field(default_factory=list)
    eqn_ops: list = field(default_factory=list)
    children: dict = field(default_factory=dict)
    trip_count: int | None = 1


class Program:
    """A lifted program: the graph the partitioner works on. Immutable once built;
    analyses derived from it are computed once and kept with it (`analysis`).

    `origin` is what `lift` traced (an `Origin`), or None for a program built otherwise.
    `rolled` holds the top-level equation indices of the layer scans `roll_layers` made
    from unrolled layers (empty otherwise)."""

    def __init__(self, *, values, ops, regions, inputs, outputs, in_tree, out_tree,
                 input_names, input_args, output_names, closed_jaxpr, fallbacks, value_names, origin=None,
                 rolled=()):
        self.values: tuple[Value, ...] = tuple(values)
        self.ops: tuple[Op, ...] = tuple(ops)
        self.regions: tuple[Region, ...] = tuple(regions)
        self.inputs: tuple[int, ...] = tuple(inputs)
        self.outputs: tuple[int, ...] = tuple(outputs)
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.input_names: tuple[str, ...] = tuple(input_names)
        #: Position of each input's argument among the (non-static) arguments.
        self.input_args: tuple[int, ...] = tuple(input_args)
        self.input_set: frozenset[int] = frozenset(self.inputs)
        self.output_names: tuple[str, ...] = tuple(output_names)
        self.closed_jaxpr = closed_jaxpr
        self.fallbacks: tuple[str, ...] = tuple(fallbacks)
        self._names: dict[int, str] = dict(value_names)
        producer = [-1] * len(self.values)
        users: list[list[int]] = [[] for _ in self.values]
        for op in self.ops:
            oid = op.id
            for v in op.results:
                if v >= 0:
                    producer[v] = oid
            for v in op.operands:
                if v >= 0:
                    u = users[v]
                    if not u or u[-1] != oid:
                        u.append(oid)
        self.producer: tuple[int, ...] = tuple(producer)
        self.users: tuple[tuple[int, ...], ...] = tuple(map(tuple, users))
        # Ops touching each value (producer first: it precedes its users in op order).
        self.value_ops: tuple[tuple[int, ...], ...] = tuple(
            tuple(u) if p < 0 else (p, *u) for u, p in zip(users, producer))
        self._by_name: dict[str, int] | None = None
        self._classes: dict = {}
        self._backward = None
        self._analyses: dict = {}
        self.origin: Origin | None = origin
        self.rolled: frozenset[int] = frozenset(rolled)

    def analysis(self, compute, *args):
        """`compute(self, *args)`, computed on the first call and kept with the program
        (keyed by the function and `args`, which must be hashable). For what tactics and
        search derive from a program alone (input roles, group signatures): it lives and
        dies with the program, and a value that fills lazily (a memo) is shared."""
        key = (compute, args)
        try:
            return self._analyses[key]
        except KeyError:
            out = self._analyses[key] = compute(self, *args)
            return out

    @property
    def classes(self):
        """The tiling classes of the program's values (see `partir._classes`)."""
        return self.classes_for(frozenset())

    def classes_for(self, detached: frozenset):
        """The tiling classes with the `detached` values kept out of every class."""
        c = self._classes.get(detached)
        if c is None:
            from ._classes import TilingClasses

            c = self._classes[detached] = TilingClasses(self, detached)
        return c

    # -- names ---------------------------------------------------------------------
    def name(self, v: int) -> str:
        """A readable name: the pytree path of an input, `primitive@file:line#id` otherwise."""
        n = self._names.get(v)
        if n is None:
            op = self.ops[self.producer[v]] if self.producer[v] >= 0 else None
            if op is None:
                n = f"value#{v}"
            elif op.link and op.operands and op.operands[0] >= 0:
                # A call's or loop's result: named after the value inside that it carries
                # out (`tanh@gpt.py:57#207`), not after the boundary (`jit.out#207`).
                n = f"{_TRAILING_ID.sub('', self.name(op.operands[0]))}#{v}"
            else:
                n = f"{op.primitive}{_source(op.eqn)}#{v}"
            self._names[v] = n
        return n

    def value(self, ref) -> Value:
        """Resolve a value id, `Value` or exact name to a `Value`."""
        return self.values[self.resolve(ref)]

    def resolve(self, ref) -> int:
        """Resolve a value id, `Value` or exact name to a value id; a clear error otherwise."""
        if isinstance(ref, Value):
            return ref.id
        if isinstance(ref, (int, np.integer)) and not isinstance(ref, bool):
            if 0 <= ref < len(self.values):
                return int(ref)
            raise PartitioningError(f"value id {ref} is out of range: the program has {len(self.values)} values")
        if isinstance(ref, str):
            if self._by_name is None:
                self._by_name = {self.name(v): v for v in range(len(self.values))}
            if ref in self._by_name:
                return self._by_name[ref]
            near = close_names(ref, self.input_names)
            hint = f"; did you mean {', '.join(near)}?" if near else f"; inputs are named like {self.input_names[0]!r}" if self.input_names else ""
            raise PartitioningError(f"no value is named {ref!r}{hint}")
        raise PartitioningError(f"cannot resolve {ref!r} to a value: pass a value id, a Value or a name")

    def match_inputs(self, pattern: str) -> list[int]:
        """Input value ids whose names match a glob (on `/`-joined keys) or `re:` regex."""
        return [v for v, n in zip(self.inputs, self.input_names) if path_matches(pattern, n)]

    # -- structure -----------------------------------------------------------------
    def multiplicity(self, region: int, while_trips: int = 1) -> float:
        """How many times a region's body runs per run of the program: the product of the
        trip counts of it and its ancestors, a `while` loop's (unknown statically) taken
        as `while_trips`."""
        return self.analysis(_multiplicities, while_trips)[region]

    def graph(self):
        """The dataflow as a `networkx.DiGraph`: nodes are op ids, an edge u->v carries
        the values u produces and v consumes (edge attribute `values`)."""
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(range(len(self.ops)))
        for op in self.ops:
            for v in op.operands:
                if v >= 0 and self.producer[v] >= 0:
                    p = self.producer[v]
                    if g.has_edge(p, op.id):
                        g.edges[p, op.id]["values"].append(v)
                    else:
                        g.add_edge(p, op.id, values=[v])
        return g

    def rematerializable(self, v: int) -> bool:
        """Is `v` made from scalars alone (`partir.made_from_scalars`) by one op that
        creates values (an iota, a broadcast constant: its traits' `creates`)? That op
        alone makes it again in any layout where it is needed instead of moving it (XLA
        does so)."""
        p = self.producer[v]
        if p < 0 or not made_from_scalars(self)[v]:
            return False
        traits = get_traits(self.ops[p].primitive)
        return traits is not None and traits.creates

    @property
    def backward(self) -> tuple[bool, ...]:
        """Per op: is it part of a backward pass? JAX names transposed equations
        `transpose(...)` in their name stack; the equations of a nested jaxpr (a scan
        body) carry only their own names, so they are backward when the equation that
        calls them is."""
        if self._backward is None:
            inside = [False] * len(self.regions)
            for r in self.regions:  # parents come before their children
                for i, children in r.children.items():
                    called = inside[r.id] or _transposed(r.jaxpr.eqns[i])
                    for c in children:
                        inside[c] = called
            self._backward = tuple(not op.link and (inside[op.region] or _transposed(op.eqn)) for op in self.ops)
        return self._backward

    def primitives(self) -> dict[str, int]:
        """Primitive name -> number of (non-link) ops, sorted by name."""
        counts: dict[str, int] = {}
        for op in self.ops:
            if not op.link:
                counts[op.primitive] = counts.get(op.primitive, 0) + 1
        return dict(sorted(counts.items()))

    def __repr__(self) -> str:
        return (f"Program({len(self.inputs)} inputs, {len(self.outputs)} outputs, {len(self.values)} values, "
                f"{len(self.ops)} ops, {len(self.regions)} regions)")


def _multiplicities(prog: Program, while_trips: int) -> tuple[float, ...]:
    mult: list[float] = []
    for r in prog.regions:  # a parent region comes before its children
        trips = while_trips if r.trip_count is None else r.trip_count
        mult.append(float(trips) * (mult[r.parent] if r.parent >= 0 else 1.0))
    return tuple(mult)


#: The `#id` that ends an intermediate's name.
_TRAILING_ID = re.compile(r"#\d+$")


@contextlib.contextmanager
def no_gc():
    """Pause the cyclic garbage collector: building or propagating over a large program
    allocates many small tuples, and a full collection of JAX's heap in the middle of
    that costs more than the work itself. Nothing made meanwhile forms cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _transposed(eqn) -> bool:
    return "transpose(" in str(getattr(getattr(eqn, "source_info", None), "name_stack", ""))


def _source(eqn) -> str:
    # The innermost frame outside JAX itself: where the user's code made this value.
    tb = getattr(getattr(eqn, "source_info", None), "traceback", None)
    if tb is None:
        return ""
    for frame in tb.frames:
        f = frame.file_name
        if f"{os.sep}jax{os.sep}" in f or f"{os.sep}jaxlib{os.sep}" in f:
            continue
        return f"@{os.path.basename(f)}:{frame.line_num}"
    return ""


def _keys(name: str) -> str:
    # "params['layers'][3]['mlp']['w1']" -> "params/layers/3/mlp/w1"
    parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)|^([A-Za-z_]\w*)", name)
    return "/".join(next(p for p in groups if p) for groups in parts)


def path_matches(pattern: str, name: str) -> bool:
    """Does an input name match a pattern? `re:...` is a regex searched in the name;
    anything else is a glob matched against the name itself or its `/`-joined keys
    (`params/layers/*/mlp/w1`)."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(_keys(name), pattern)


def close_names(ref: str, names, n: int = 3) -> list[str]:
    """Up to `n` names closest to `ref` (for error messages)."""
    import difflib

    keyed = {_keys(x): x for x in names}
    probe = ref[3:] if ref.startswith("re:") else ref if "/" in ref else _keys(ref)
    hits = difflib.get_close_matches(probe, list(keyed), n=n, cutoff=0.5)
    return [keyed[h] for h in hits]
