"""Count the collectives XLA really inserted into a compiled, partitioned program.

The sharding planner and the cost model predict communication; this module reads
what XLA actually emitted (``jitted.lower(*args).compile().as_text()``) so that
predictions can be checked against it.

Facts about the compiled HLO text this parser relies on (JAX 0.10.2, CPU, checked
by ``tests/test_hlo.py``):

* Device ids in ``replica_groups`` / ``source_target_pairs`` are *logical* ids
  (partition ids), i.e. positions in ``mesh.devices.flat``, not ``Device.id``: a
  mesh built from a permuted device list compiles to the same HLO text, and
  ``compiled.runtime_executable().local_devices()[i] is mesh.devices.flat[i]``.
* Operands are printed by name only (``all-reduce(%param.1)``), so operand shapes
  are looked up from the defining instruction (inline types are accepted too).
* ``replica_groups`` comes in three spellings: explicit ``{{0,1},{2,3}}`` (``{}``
  = every device), iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and the mesh-axes
  form ``mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}`` that
  GSPMD emits for ``jax.jit`` with shardings (axis names there are XLA's own,
  unrelated to the JAX mesh, so groups are materialised and matched by content).
* XLA CPU emits no async collectives; on other backends ``all-reduce-start``
  returns the result, while ``all-gather-start`` and ``collective-permute-start``
  return ``(operand(s), result(s)[, u32[] contexts])``. Ops XLA wraps in
  ``async-start(..., calls=%c)`` appear as plain collectives inside ``%c``.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

import jax
import numpy as np

from ._reshard import Kind

__all__ = ["Collective", "collective_buffers", "collectives", "collectives_of", "summarize"]

_KINDS = tuple(k.value for k in Kind if k.communicates)

# Bits per element (every f8 variant is 8); sub-byte types round up per buffer.
_BITS = dict(pred=8, s8=8, u8=8, s16=16, u16=16, f16=16, bf16=16, s32=32, u32=32, f32=32,
             s64=64, u64=64, f64=64, c64=64, c128=128, s4=4, u4=4, s2=2, u2=2, s1=1, u1=1,
             f4e2m1fn=4, token=0)

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_ARRAY_RE = re.compile(r"(\w+)\[([^\]]*)\](\{[^}]*\})?")
_COLL_RE = re.compile(r"\s+((?:" + "|".join(_KINDS) + r")(?:-start)?)\(")
_CALLEE_RE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALLEE_LIST_RE = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_GROUPS_EXPLICIT_RE = re.compile(r"replica_groups=(\{(?:\{[\d,\s]*\},?\s*)*\})")
_GROUPS_IOTA_RE = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH_RE = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}")
_PAIRS_RE = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?\s*)*)\}")


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective instruction found in compiled HLO.

    ``axes`` are the JAX mesh axes (in mesh order) whose device groups equal this
    collective's replica groups; ``()`` when no subset of axes matches. When
    several subsets match (size-1 axes), the one with the fewest axes wins. For a
    collective-permute, ``axes`` are the axes along which some source and target
    differ and ``group_size`` is the product of those axes' sizes. Byte counts are
    per device and are what XLA moves (e.g. XLA CPU runs a bf16 all-reduce in
    f32); ``shapes`` lists ``(dtype, dims)`` of each result buffer.
    """

    kind: Kind
    axes: tuple[str, ...]
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    result_bytes: int
    operand_bytes: int
    group_size: int
    computation: str
    in_loop: bool
    name: str
    op_name: str = ""  # the JAX op name from the metadata (its name stack shows the pass)


# --- shapes -----------------------------------------------------------------

def _parse_shape(s: str, i: int = 0):
    """Parse one HLO shape at ``s[i:]``: a leaf ``(dtype, dims)`` or a list of shapes."""
    i = len(s) - len(s[i:].lstrip())
    if s[i] == "(":
        items, i = [], i + 1
        while s[i:].lstrip(" ,")[0] != ")":
            item, i = _parse_shape(s, len(s) - len(s[i:].lstrip(" ,")))
            items.append(item)
        return items, s.index(")", i) + 1
    m = _ARRAY_RE.match(s, i)
    if not m:
        raise ValueError(f"cannot parse HLO shape at: {s[i:i + 60]!r}")
    # Dynamic dims print as '<=N'; the buffer is sized for the bound.
    dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    return (m.group(1), dims), m.end()


def _leaves(shape) -> list[tuple[str, tuple[int, ...]]]:
    """The array buffers of a (possibly nested tuple) shape, in order."""
    if isinstance(shape, tuple):
        return [shape]
    return [leaf for item in shape for leaf in _leaves(item)]


def _nbytes(leaves) -> int:
    """Bytes of a list of ``(dtype, dims)`` buffers."""
    total = 0
    for dtype, dims in leaves:
        bits = 8 if dtype.startswith("f8") else _BITS.get(dtype)
        if bits is None:
            raise ValueError(f"unknown HLO element type {dtype!r}")
        total += -(-math.prod(dims) * bits // 8)
    return total


def _split_top(s: str) -> list[str]:
    """Split on commas that are not nested in (), [] or {}."""
    out, depth, cur = [], 0, ""
    for ch in s + ",":
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out += [cur.strip()] if cur.strip() else []
            cur = ""
        else:
            cur += ch
    return out


# --- replica groups -----------------------------------------------------------

def _groups(attrs: str, n_devices: int) -> list[list[int]] | None:
    """The replica groups of a collective, as lists of logical device ids."""
    if m := _GROUPS_IOTA_RE.search(attrs):
        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(shape)).reshape([int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(-1, shape[-1]).tolist()
    if m := _GROUPS_MESH_RE.search(attrs):
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    if m := _GROUPS_EXPLICIT_RE.search(attrs):
        groups = [[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d,\s]+)\}", m.group(1))]
        # '{}' means a single group holding every device.
        return groups or [list(range(n_devices))]
    return None


def _mesh_groups(mesh_s: str, ids_s: str | None, axes_s: str) -> list[list[int]]:
    """Materialise XLA's ``mesh[...] {axes}`` replica groups.

    Axis entries are ``name`` (whole axis) or ``name:(pre)size``, a sub-axis: the
    axis index ``c`` splits as ``c = hi*size*pre + mid*pre + lo`` and the group
    varies along ``mid``.
    """
    names, sizes = [], []
    for entry in _split_top(mesh_s):
        name, size = entry.rsplit("=", 1)
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    n = math.prod(sizes)
    if ids_s is None:
        ids = np.arange(n)
    elif m := re.fullmatch(r"\s*\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?\s*", ids_s):
        # Iota device list: reshape iota to the last bracket, transpose.
        dims = [int(x) for x in (m.group(2) or m.group(1)).split(",")]
        ids = np.arange(n).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    else:
        ids = np.array([int(x) for x in re.findall(r"\d+", ids_s)])
    ids = ids.reshape(sizes)
    varying: dict[int, list[tuple[int, int]]] = {}
    for entry in _split_top(axes_s):
        sub = re.fullmatch(r"(.*?):\((\d+)\)(\d+)", entry)
        name = (sub.group(1) if sub else entry).strip().strip("'\"")
        d = names.index(name)
        pre, size = (int(sub.group(2)), int(sub.group(3))) if sub else (1, sizes[d])
        varying.setdefault(d, []).append((pre, size))
    groups: dict[tuple[int, ...], list[int]] = {}
    for idx in itertools.product(*(range(s) for s in sizes)):
        key = list(idx)
        for d, parts in varying.items():
            for pre, size in parts:
                key[d] -= ((key[d] // pre) % size) * pre
        groups.setdefault(tuple(key), []).append(int(ids[idx]))
    return list(groups.values())


def _axis_partitions(mesh: jax.sharding.Mesh) -> list[tuple[frozenset, tuple[str, ...]]]:
    """For each non-empty subset of mesh axes (fewest axes first), its device groups."""
    names, shape = tuple(mesh.axis_names), mesh.devices.shape
    ids = np.arange(math.prod(shape)).reshape(shape)  # logical id = flat position
    out = []
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), r):
            rest = [d for d in range(len(names)) if d not in subset]
            rows = ids.transpose(rest + list(subset)).reshape(-1, math.prod(shape[d] for d in subset))
            out.append((frozenset(frozenset(row.tolist()) for row in rows),
                        tuple(names[d] for d in subset)))
    return out


def _permute_axes(attrs: str, mesh: jax.sharding.Mesh) -> tuple[tuple[str, ...], int]:
    """Mesh axes along which some source/target pair differs, and their total size."""
    m = _PAIRS_RE.search(attrs)
    pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", m.group(1))] if m else []
    shape = mesh.devices.shape
    differ = set()
    for s, t in pairs:
        cs, ct = np.unravel_index(s, shape), np.unravel_index(t, shape)
        differ |= {d for d in range(len(shape)) if cs[d] != ct[d]}
    dims = sorted(differ)
    return tuple(mesh.axis_names[d] for d in dims), math.prod(shape[d] for d in dims)


# --- module structure ---------------------------------------------------------

def _parse_module(hlo_text: str):
    """Index instructions by name and find the computations that run in a loop.

    Returns ``({name: (computation, text after '=')}, {computations in a loop},
    {computation: the computations it calls})``.
    """
    instrs: dict[str, tuple[str, str]] = {}  # name -> (computation, rest of line)
    calls: dict[str, set[str]] = {}
    loop_roots: set[str] = set()
    entry, comp = None, None
    for line in hlo_text.splitlines():
        if comp is None:
            if m := _COMP_RE.match(line):
                comp = m.group(2)
                calls.setdefault(comp, set())
                if m.group(1):
                    entry = comp
            continue
        if line.strip() == "}":
            comp = None
            continue
        if not (m := _INSTR_RE.match(line)):
            continue
        name, rest = m.groups()
        # Long tuples and operand lists carry '/*index=5*/' markers.
        rest = _COMMENT_RE.sub("", rest)
        instrs[name] = (comp, rest)
        callees = set(_CALLEE_RE.findall(rest))
        for lst in _CALLEE_LIST_RE.findall(rest):
            callees |= {c.strip().lstrip("%") for c in lst.split(",") if c.strip()}
        calls[comp] |= callees
        if re.search(r"\swhile\(", rest):
            loop_roots |= set(re.findall(r"\b(?:body|condition)=%?([\w.\-]+)", rest))
    # Everything reachable from a while body/condition runs inside a loop.
    in_loop = _called(calls, loop_roots)
    in_loop.discard(entry)
    return instrs, in_loop, calls


def _called(calls: dict, roots) -> set[str]:
    """`roots` and the computations they call (`calls`: computation -> its callees),
    directly or not."""
    out, stack = set(), list(roots)
    while stack:
        c = stack.pop()
        if c not in out:
            out.add(c)
            stack.extend(calls.get(c, ()))
    return out


def reachable(hlo_text: str, roots) -> set[str]:
    """The computations of compiled HLO text that the computations `roots` run, directly
    or through the ones they call (a loop body's conditionals and inner loops), `roots`
    included."""
    return _called(_parse_module(hlo_text)[2], roots)


def _operand_leaves(operands: str, instrs) -> list:
    """The buffers of an operand list, from inline types or the defining instructions."""
    leaves = []
    for item in _split_top(operands):
        if item[:1] != "%" and (item[:1] == "(" or _ARRAY_RE.match(item)):
            shape, _ = _parse_shape(item)  # inline-typed operand: 'f32[4,8]{1,0} %x'
            leaves += _leaves(shape)
            continue
        ref = item.split()[-1].lstrip("%")
        if ref not in instrs:
            raise ValueError(f"operand {ref!r} is not defined in the HLO text")
        leaves += _leaves(_parse_shape(instrs[ref][1])[0])
    return leaves


def collectives(hlo_text: str, mesh: jax.sharding.Mesh) -> list[Collective]:
    """Every collective in compiled HLO text, in text order.

    Counts sync collectives and the ``-start`` half of async ones (reported under
    the base kind); ``-done`` halves are skipped. ``mesh`` is the mesh the program
    was partitioned over: its flat device positions are the HLO's logical ids.
    """
    instrs, in_loop, _ = _parse_module(hlo_text)
    partitions = _axis_partitions(mesh)
    n = mesh.devices.size
    found = []
    for name, (comp, rest) in instrs.items():
        # Cheap filter first, so shapes are parsed only for collectives.
        if not _COLL_RE.search(rest):
            continue
        shape, end = _parse_shape(rest)
        if not (m := _COLL_RE.match(rest, end)):  # the opcode right after the shape
            continue
        opcode = m.group(1)
        kind = Kind(opcode.removesuffix("-start"))
        # Operand list: up to the matching ')'.
        depth, j = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(rest[j], 0)
            j += 1
        operands, attrs = rest[m.end():j - 1], rest[j:]
        async_with_operand = opcode in ("all-gather-start", "collective-permute-start")
        if async_with_operand and isinstance(shape, list) and len(shape) >= 2:
            # These return (operand(s), result(s)[, u32[] contexts]): keep the result.
            shape = shape[1]
        leaves = _leaves(shape)
        if kind == Kind.COLLECTIVE_PERMUTE:
            axes, size = _permute_axes(attrs, mesh)
        else:
            groups = _groups(attrs, n) or [list(range(n))]  # no replica_groups: all devices
            key = frozenset(frozenset(g) for g in groups)
            axes = next((a for part, a in partitions if part == key), ())
            size = len(groups[0])
        found.append(Collective(
            kind=kind, axes=axes, shapes=tuple(leaves), result_bytes=_nbytes(leaves),
            operand_bytes=_nbytes(_operand_leaves(operands, instrs)), group_size=size,
            computation=comp, in_loop=comp in in_loop, name=name, op_name=_op_name(attrs)))
    return found


_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


def _op_name(attrs: str) -> str:
    m = _OP_NAME_RE.search(attrs)
    return m.group(1) if m else ""


def collectives_of(jitted, *args, mesh: jax.sharding.Mesh) -> list[Collective]:
    """Compile ``jitted`` for ``args`` and return the collectives XLA inserted."""
    return collectives(jitted.lower(*args).compile().as_text(), mesh)


def summarize(cols) -> dict[tuple[str, tuple[str, ...]], tuple[int, int]]:
    """Group collectives by ``(kind, axes)`` into ``(count, total result bytes)``."""
    out: dict[tuple[str, tuple[str, ...]], tuple[int, int]] = {}
    for c in cols:
        n, b = out.get((c.kind, c.axes), (0, 0))
        out[c.kind, c.axes] = (n + 1, b + c.result_bytes)
    return out


def collective_buffers(cols, *, reduce_scatter: bool = True) -> "collections.Counter":
    """How many collectives of each `(kind, axes, bytes per device)` there are, counting
    one per buffer: a tuple all-reduce (XLA combines gradient all-reduces into one) or
    all-gather counts per member, an all-to-all once whatever its operand count (XLA:CPU
    passes one operand per peer). With `reduce_scatter=False` a reduce-scatter counts as
    the all-reduce of its operand, as a cost model for a backend without one charges it.
    The form in which `search.CostModel`'s list of collectives compares exactly."""
    import collections

    out = collections.Counter()
    for c in cols:
        if c.kind == Kind.ALL_TO_ALL:
            out[c.kind, c.axes, c.result_bytes] += 1
        elif c.kind == Kind.REDUCE_SCATTER and not reduce_scatter:
            out[Kind.ALL_REDUCE, c.axes, c.operand_bytes] += 1
        else:
            for shape in c.shapes:
                out[c.kind, c.axes, _nbytes([shape])] += 1
    return out
