"""Nested primitives: the equations whose params hold jaxprs (`scan`, `while`, `cond`,
`remat2`/`checkpoint` and the call-like primitives).

One registry keyed by primitive name, as JAX keeps a primitive's rules together: each
entry says how the equation's operands split into named groups, how `lift` turns it
into child regions joined to their parent by link ops (`Link`), and how it is
evaluated again from its child regions (`lax.scan`, `lax.while_loop`, `lax.switch`,
`jax.checkpoint`, or inline for a call). Evaluation takes the child-region interpreter
as a callback, so the `jit` lowering and a per-device interpreter share it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr

from ._compat import scan_counts
from ._errors import PartitioningError


class Link(enum.StrEnum):
    """The kinds of link ops (`Op.primitive` of an op with `Op.link`): identity factor
    rules at region boundaries, named by nested primitive and the operands they carry."""

    CALL_IN = "call.in"  # a call's operand -> the callee's invar
    CALL_OUT = "call.out"  # the callee's outvar -> the call's result
    SCAN_CONST = "scan.const"  # a scan's constant -> the body's invar
    SCAN_CARRY_IN = "scan.carry_in"  # a scan's initial carry -> the body's carry invar
    SCAN_XS = "scan.xs"  # a stacked `[L, ...]` input -> its per-iteration slice (`L` blocked)
    SCAN_CARRY_LOOP = "scan.carry_loop"  # the body's carry out -> its carry in
    SCAN_CARRY_OUT = "scan.carry_out"  # the body's carry out -> the scan's carry result
    SCAN_YS = "scan.ys"  # a per-iteration output -> the stacked `[L, ...]` result (`L` blocked)
    WHILE_CONST = "while.const"  # a while's constant -> the cond's or body's invar
    WHILE_CARRY_IN = "while.carry_in"  # the initial carry -> the cond's and body's carry invars
    WHILE_CARRY_LOOP = "while.carry_loop"  # the body's carry out -> the cond's and body's carry in
    WHILE_CARRY_OUT = "while.carry_out"  # the body's carry out -> the while's result
    COND_IN = "cond.in"  # a cond's operand -> each branch's invar
    COND_OUT = "cond.out"  # each branch's outvar -> the cond's result


# -- operand groups ------------------------------------------------------------------


class CallOperands(NamedTuple):
    """A call's operands: all go to the callee's invars."""

    operands: Sequence


class ScanOperands(NamedTuple):
    """A scan's operands: loop constants, initial carry, stacked inputs."""

    consts: Sequence
    carry: Sequence
    xs: Sequence


class WhileOperands(NamedTuple):
    """A while loop's operands: the cond's constants, the body's constants, the carry."""

    cond_consts: Sequence
    body_consts: Sequence
    carry: Sequence


class CondOperands(NamedTuple):
    """A cond's operands: the branch index, then the branches' operands."""

    index: Sequence
    operands: Sequence


def _no_counts(params) -> tuple[int, ...]:
    return ()


def _while_counts(params) -> tuple[int, ...]:
    return params["cond_nconsts"], params["body_nconsts"]


# -- the registry ----------------------------------------------------------------------


@dataclass(frozen=True)
class NestedPrimitive:
    """How automap handles one primitive whose params hold jaxprs.

    `groups` is the NamedTuple of its operand groups and `counts(params)` the lengths of
    all groups but the last (which takes the rest). `lift(builder, region, eqn,
    operands, results)` builds its child regions and their links in `partir._lift` and
    returns the child region ids; `evaluate(eqn, children, operands, run)` computes its
    results, `run(child, args)` interpreting one child region on `args`. `operands` are
    split into groups by `split_operands`.
    """

    groups: type
    counts: Callable[[dict], tuple[int, ...]]
    lift: Callable
    evaluate: Callable


_REGISTRY: dict[str, NestedPrimitive] = {}


def register_nested(entry: NestedPrimitive, *names: str) -> NestedPrimitive:
    """Register `entry` for the primitives `names`."""
    for name in names:
        _REGISTRY[name] = entry
    return entry


def nested_primitive(name: str) -> NestedPrimitive:
    """The entry of nested primitive `name`; a `PartitioningError` listing the known
    ones when it has none."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise PartitioningError(
            f"primitive {name!r} has no nested-primitive entry; known: {', '.join(sorted(_REGISTRY))}. "
            "Register one with partir._nested.register_nested")
    return entry


def split_operands(eqn, operands: Sequence):
    """`operands` of nested equation `eqn` (value ids, arrays, tracers: one per equation
    operand, or per invar of a child region laid out alike) split into the named groups
    of its entry (`ScanOperands(consts, carry, xs)`, ...)."""
    entry = nested_primitive(eqn.primitive.name)
    parts, i = [], 0
    for n in entry.counts(eqn.params):
        parts.append(operands[i:i + n])
        i += n
    parts.append(operands[i:])
    return entry.groups(*parts)


def evaluate_nested(eqn, children, operands: Sequence, run) -> list:
    """The results of nested equation `eqn` on `operands`, from its child regions
    `children`; `run(child, args)` interprets one child region on `args` (and may
    constrain or otherwise act on the values it defines)."""
    entry = nested_primitive(eqn.primitive.name)
    return list(entry.evaluate(eqn, children, split_operands(eqn, operands), run))


def nested_entry(eqn) -> NestedPrimitive | None:
    """The entry for `eqn` when it is a registered nested primitive holding its jaxprs in
    its params, else None (the equation is then an ordinary op)."""
    entry = _REGISTRY.get(eqn.primitive.name)
    return entry if entry is not None and _holds_jaxprs(eqn) else None


def _holds_jaxprs(eqn) -> bool:
    for v in eqn.params.values():
        if isinstance(v, (Jaxpr, ClosedJaxpr)):
            return True
        if isinstance(v, tuple) and v and all(isinstance(x, (Jaxpr, ClosedJaxpr)) for x in v):
            return True
    return False


def sub_jaxprs(eqn) -> list:
    """The (Closed)Jaxprs among `eqn`'s params."""
    return [v for v in eqn.params.values() if isinstance(v, (Jaxpr, ClosedJaxpr))]


# -- calls and remat -----------------------------------------------------------------


def _lift_call(b, rid, eqn, ins: CallOperands, outs):
    (sub,) = sub_jaxprs(eqn)
    child, _, ovs = b.sub(eqn.primitive.name, rid, sub,
                          enter=lambda ivs: b.links(Link.CALL_IN, ins.operands, ivs, rid))
    b.links(Link.CALL_OUT, ovs, outs, rid)
    return (child,)


def _eval_call(eqn, children, ins: CallOperands, run):
    (child,) = children
    return run(child, ins.operands)


def _eval_remat(eqn, children, ins: CallOperands, run):
    (child,) = children
    p = eqn.params
    body = jax.checkpoint(lambda *a: run(child, a), prevent_cse=p.get("prevent_cse", True), policy=p.get("policy"))
    return body(*ins.operands)


# Calls and custom-derivative calls run their one jaxpr once, as is, on their operands.
register_nested(NestedPrimitive(CallOperands, _no_counts, _lift_call, _eval_call),
                "jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                "custom_vjp_call_jaxpr", "composite")
register_nested(NestedPrimitive(CallOperands, _no_counts, _lift_call, _eval_remat), "remat2", "checkpoint")


# -- scan ------------------------------------------------------------------------------


def _lift_scan(b, rid, eqn, ins: ScanOperands, outs):
    p = eqn.params
    nk = len(ins.carry)

    def enter(ivs):
        iv = split_operands(eqn, ivs)
        b.links(Link.SCAN_CONST, ins.consts, iv.consts, rid)
        b.links(Link.SCAN_CARRY_IN, ins.carry, iv.carry, rid)
        b.links(Link.SCAN_XS, ins.xs, iv.xs, rid, blocked_lead=1)

    child, ivs, ovs = b.sub("scan", rid, p["jaxpr"], trip_count=int(p["length"]), enter=enter)
    b.links(Link.SCAN_CARRY_LOOP, ovs[:nk], split_operands(eqn, ivs).carry, child)
    b.links(Link.SCAN_CARRY_OUT, ovs[:nk], outs[:nk], rid)
    b.links(Link.SCAN_YS, ovs[nk:], outs[nk:], rid, blocked_lead=-1)
    return (child,)


def _eval_scan(eqn, children, ins: ScanOperands, run):
    (child,) = children
    p = eqn.params
    nk = len(ins.carry)

    def body(carry, x):
        outs = run(child, [*ins.consts, *carry, *x])
        return tuple(outs[:nk]), tuple(outs[nk:])

    carry, ys = jax.lax.scan(body, tuple(ins.carry), tuple(ins.xs), length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
    return [*carry, *ys]


register_nested(NestedPrimitive(ScanOperands, scan_counts, _lift_scan, _eval_scan), "scan")


# -- while -----------------------------------------------------------------------------


def _lift_while(b, rid, eqn, ins: WhileOperands, outs):
    p = eqn.params
    cn, bn = len(ins.cond_consts), len(ins.body_consts)

    def enter(consts, n):
        def link(ivs):
            b.links(Link.WHILE_CONST, consts, ivs[:n], rid)
            b.links(Link.WHILE_CARRY_IN, ins.carry, ivs[n:], rid)
        return link

    # The trip count of a while loop is unknown statically (None).
    cid, civ, _ = b.sub("while.cond", rid, p["cond_jaxpr"], trip_count=None, enter=enter(ins.cond_consts, cn))
    bid, biv, bov = b.sub("while.body", rid, p["body_jaxpr"], trip_count=None, enter=enter(ins.body_consts, bn))
    b.links(Link.WHILE_CARRY_LOOP, bov, biv[bn:], bid)
    b.links(Link.WHILE_CARRY_LOOP, bov, civ[cn:], bid)
    b.links(Link.WHILE_CARRY_OUT, bov, outs, rid)
    return (cid, bid)


def _eval_while(eqn, children, ins: WhileOperands, run):
    cid, bid = children

    def cond(carry):
        return run(cid, [*ins.cond_consts, *carry])[0]

    def body(carry):
        return tuple(run(bid, [*ins.body_consts, *carry]))

    return list(jax.lax.while_loop(cond, body, tuple(ins.carry)))


register_nested(NestedPrimitive(WhileOperands, _while_counts, _lift_while, _eval_while), "while")


# -- cond ------------------------------------------------------------------------------


def _lift_cond(b, rid, eqn, ins: CondOperands, outs):
    children = []
    for branch in eqn.params["branches"]:
        child, _, ovs = b.sub("cond.branch", rid, branch,
                              enter=lambda ivs: b.links(Link.COND_IN, ins.operands, ivs, rid))
        b.links(Link.COND_OUT, ovs, outs, rid)
        children.append(child)
    return tuple(children)


def _eval_cond(eqn, children, ins: CondOperands, run):
    (index,) = ins.index
    branches = [lambda *a, c=c: run(c, a) for c in children]
    return jax.lax.switch(index, branches, *ins.operands)


register_nested(NestedPrimitive(CondOperands, lambda p: (1,), _lift_cond, _eval_cond), "cond")
