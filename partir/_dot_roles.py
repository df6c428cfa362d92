"""The roles of a layer's matmuls, read from its dataflow (never from names), for the
rematerialization policies that keep some matmuls' outputs and recompute the others,
as MaxText's named policies do (`save_qkv_proj`, `save_dot_except_mlpwi`).

A *projection* is a matmul with no batch dims (`partir._remat`'s plain dot) in the
layer's forward pass; an attention *core* is a matmul with batch dims both of whose
operands are activations (the scores `q k^T` and `p v`, per batch and head). A matmul
*reaches* the projections and cores its output is read by through other ops only
(reshapes, casts, the rotary embedding, norms, the residual stream's add, an
activation function, a gate's product): no other matmul in between. Each projection
then has the first of these roles that fits it:

    qkv            it reaches a core: the attention's query, key and value projections
                   (fused into one or not)
    attention_out  a core reaches it: the attention's output projection
    mlp_out        it reaches nothing in the layer: the layer's last matmul (the MLP's
                   down projection), whose output only the residual stream reads
    mlp_in         it reaches an `mlp_out` projection: the MLP's up and gate projections
    other          none of these (a layer with no attention and more than two matmuls
                   in a chain, say)
"""

from __future__ import annotations

from ._layers import weight_derived
from ._nested import Link

#: The roles a layer's projections can have (module docstring), in the order tried.
DOT_ROLES = ("qkv", "attention_out", "mlp_out", "mlp_in", "other")


def dot_roles(program, layer) -> dict[int, str]:
    """Per projection op of `layer` (a `partir.Layer`), its role (`DOT_ROLES`), kept with
    the program per layer."""
    return program.analysis(_dot_roles, layer)


def _dot_roles(program, layer) -> dict[int, str]:
    inside = set(layer.ops)
    backward = program.backward
    kinds = {o: _kind(program, o) for o in layer.ops if not backward[o]}
    reaches = {o: _reached(program, o, inside, kinds, backward) for o, k in kinds.items() if k == "projection"}
    cores = {o for o, k in kinds.items() if k == "core"}
    reached_from_core = {p for c in cores for p in _reached(program, c, inside, kinds, backward)}
    roles = {}
    for o, out in reaches.items():
        if out & cores:
            roles[o] = "qkv"
        elif o in reached_from_core:
            roles[o] = "attention_out"
        elif not out:
            roles[o] = "mlp_out"
    for o, out in reaches.items():
        if o not in roles:
            roles[o] = "mlp_in" if any(roles.get(p) == "mlp_out" for p in out) else "other"
    return roles


def attention_outputs(program, layer) -> tuple[int, ...]:
    """The attention cores of `layer` whose output reaches a projection through other
    ops only (`p v`, the attention's output, where `q k^T` reaches another core), in
    program order."""
    return program.analysis(_attention_outputs, layer)


def _attention_outputs(program, layer) -> tuple[int, ...]:
    inside = set(layer.ops)
    backward = program.backward
    kinds = {o: _kind(program, o) for o in layer.ops if not backward[o]}
    return tuple(o for o, k in sorted(kinds.items())
                 if k == "core" and any(kinds[p] == "projection" for p in _reached(program, o, inside, kinds, backward)))


def _kind(program, o: int) -> str | None:
    """'projection', 'core' or None (any other op)."""
    op = program.ops[o]
    if op.link or op.primitive != "dot_general":
        return None
    (_, _), (lb, _) = op.eqn.params["dimension_numbers"]
    if not lb:
        return "projection"
    return "core" if not any(_weight_made(program, u) for u in op.operands if u >= 0) else None


def _weight_made(program, v: int) -> bool:
    """Is `v` made from layer parameters and constants alone, off the activations'
    path (a weight, its cast or slice, an expert's kernel, a causal mask)?"""
    return program.analysis(_weights)[v]


def _weights(program) -> list[bool]:
    return weight_derived(program, program.backward)


def _reached(program, start: int, inside: set, kinds: dict, backward) -> frozenset:
    """The projections and cores of the layer that `start`'s output reaches through
    other forward ops of the layer only (links included: a call's boundary, a scan's
    carry)."""
    found, seen = set(), set()
    stack = [r for r in program.ops[start].results if r >= 0]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for u in program.users[v]:
            if u not in inside or backward[u]:
                continue
            if kinds.get(u) is not None:
                found.add(u)
                continue
            op = program.ops[u]
            if op.link and op.primitive == Link.SCAN_YS:
                continue  # (stacked for the backward: out of the layer's forward pass)
            stack += [r for r in op.results if r >= 0]
    return frozenset(found)
