"""The user's own `jax.checkpoint`: what it recomputes, so a plan can keep, tighten or
relax it.

Differentiating a layer wrapped in `jax.checkpoint` leaves its forward ops in the
forward pass and puts, in the backward pass, a `checkpoint` (`remat2`) region that
runs again the forward ops the user's policy did not save, from the layer's inputs and
the values it saved, then the layer's backward ops. Each op of that region that runs a
forward op again (the same primitive and params on the same values) is a *rerun* of the
forward op; its results are reruns of the forward op's results. A value is the same on
both sides of a call boundary and across a scan's two loops (a forward body's
per-iteration output and the backward body's slice of its stack; the two bodies' slices
of one stacked input).

A plan *keeps* the user's checkpoint when it changes nothing, *tightens* it when it
recomputes values the user's policy saved (`partir.recomputed`: the saved values are
the layer's residuals), and *relaxes* it when it keeps forward values the user's
region recomputes: the region's reruns then read the forward values (`reusable`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend.core import Literal

from ._graph import made_from_scalars
from ._nested import Link
from ._remat import KEEPING_DOTS, _communicates, _plain_dot, check_policy, layers_of, saved_dots

#: The region kinds of `jax.checkpoint`.
CHECKPOINT_KINDS = ("remat2", "checkpoint")
#: Regions that run once per run of their parent, their invars the equation's operands.
_CALLS = CHECKPOINT_KINDS + ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                             "custom_vjp_call_jaxpr", "composite")


@dataclass(frozen=True)
class UserCheckpoint:
    """One backward `jax.checkpoint` region of the user's program: its `region` id, the
    `policy` the user gave (`policy_name` for people: `full` for JAX's default, which
    saves only the inputs) and its `reruns`, `(value in the region, forward value it
    recomputes)` pairs in program order."""

    region: int
    policy: object
    policy_name: str
    reruns: tuple[tuple[int, int], ...]


def policy_name(policy) -> str:
    """The name of JAX checkpoint policy `policy` among `partir.REMAT_POLICIES`, or its
    repr for one that has no such name."""
    cp = jax.checkpoint_policies
    known = {"full": (None, cp.nothing_saveable), "dots": (cp.dots_with_no_batch_dims_saveable,),
             "none": (cp.everything_saveable,)}
    return next((name for name, ps in known.items() if any(policy is p or policy == p for p in ps)), repr(policy))


def user_checkpoints(program) -> tuple[UserCheckpoint, ...]:
    """The backward `jax.checkpoint` regions of `program` (cached with it)."""
    return program.analysis(_find_checkpoints)


def reruns_of(program) -> dict[int, int]:
    """Every user checkpoint's reruns: recomputed value -> the forward value."""
    return program.analysis(_all_twins)


def _all_twins(program) -> dict[int, int]:
    return {w: v for c in user_checkpoints(program) for w, v in c.reruns}


def checkpoints_of(program, layer) -> tuple[UserCheckpoint, ...]:
    """The user's checkpoints that recompute values of `layer` (a `partir.Layer`): each
    belongs to the layer most of its reruns' forward values are made in (a causal mask
    any layer makes is any layer's rerun)."""
    return program.analysis(_checkpoint_blocks).get(layer.index, ())


def _checkpoint_blocks(program) -> dict[int, tuple]:
    owner = {o: b.index for b in layers_of(program) for o in b.ops}
    found: dict[int, list] = {}
    for c in user_checkpoints(program):
        count = Counter(owner[program.producer[v]] for _, v in c.reruns if program.producer[v] in owner)
        if count:
            found.setdefault(count.most_common(1)[0][0], []).append(c)
    return {b: tuple(cs) for b, cs in found.items()}


def remat_layers(program) -> tuple:
    """The layers (`partir.layers_of`) a rematerialization policy can change: those
    with residuals, and those whose recomputation the user's checkpoint does."""
    return tuple(b for b in layers_of(program) if b.residuals or checkpoints_of(program, b))


def reusable(program, layer, policy: str, part=None) -> tuple[tuple[int, int], ...]:
    """The reruns `(recomputed, forward)` of `layer`'s user checkpoints whose forward value
    `policy` keeps: relaxing the checkpoint to `policy` reads those forward values in
    the backward pass instead of recomputing them."""
    check_policy(policy)
    ckpts = checkpoints_of(program, layer)
    if not ckpts or policy == "full":
        return ()
    made_of_scalars = made_from_scalars(program)  # a causal mask: remade for free, never kept

    def dot(v):  # the matmul itself: a view of it is recomputed from it for free
        return program.ops[program.producer[v]].primitive == "dot_general" and _plain_dot(program, v)

    saved = set(saved_dots(program, layer, policy))  # (none but under SAVING's policies)

    def keep(v):  # as `recomputed` keeps a residual
        if policy == "none" or v in saved:
            return True
        if policy == "collectives" and _communicates(part, program.producer[v]):
            return True
        return policy in KEEPING_DOTS and dot(v)

    return tuple((w, v) for c in ckpts for w, v in c.reruns if keep(v) and not made_of_scalars[v])


def _find_checkpoints(program) -> tuple[UserCheckpoint, ...]:
    backward = program.backward
    by_region: dict[int, list] = {}
    for op in program.ops:
        by_region.setdefault(op.region, []).append(op)
    regions = [r for r in program.regions if r.kind in CHECKPOINT_KINDS and r.parent >= 0
               and any(backward[o.id] for o in by_region.get(r.id, ()))]
    if not regions:
        return ()
    canon = _Canon(program)
    forward: dict[tuple, list] = {}
    for op in program.ops:
        if not op.link and not backward[op.id] and op.eqn is not None:
            alike = forward.setdefault(canon.key(op), [])
            first = next((f for f in alike if _same_params(f.eqn, op.eqn)), None)
            if first is None:
                alike.append(op)
            else:  # the forward pass computes it twice (jaxprs are not CSE'd): one value
                canon.alias(op.results, first.results)
    found = []
    for r in regions:
        parent = program.regions[r.parent]
        eqn = next(parent.jaxpr.eqns[i] for i, c in parent.children.items() if r.id in c)
        reruns = []
        for op in sorted((o for rid in _inside(program, r.id) for o in by_region.get(rid, ())), key=lambda o: o.id):
            if op.link:
                continue
            match = next((f for f in forward.get(canon.key(op), ()) if _same_params(f.eqn, op.eqn)), None)
            if match is None:
                continue
            reruns += [(w, v) for w, v in zip(op.results, match.results) if w >= 0 and v >= 0]
            canon.alias(op.results, match.results)
        policy = eqn.params.get("policy")
        found.append(UserCheckpoint(r.id, policy, policy_name(policy), tuple(reruns)))
    return tuple(found)


def _inside(program, rid: int) -> set[int]:
    """Region `rid` and the call regions within it."""
    inside = {rid}
    for r in program.regions:
        if r.parent in inside and r.kind in _CALLS:
            inside.add(r.id)
    return inside


def _literal(x: Literal) -> tuple:
    val = np.asarray(x.val)
    return ("literal", val.dtype, val.tobytes())


def _same_params(a, b) -> bool:
    try:
        return bool(a.params == b.params)
    except (ValueError, TypeError):  # params holding arrays: not compared, not reruns
        return False


class _Canon:
    """What a value is, seen through call boundaries and across a scan's two loops: the
    same key on both sides means the same value."""

    def __init__(self, program):
        self.prog = program
        self.same: dict[int, tuple] = {}
        for r in program.regions:  # a call's literal operand: its callee's invar has no link
            for i, children in r.children.items():
                eqn = r.jaxpr.eqns[i]
                for c in children:
                    if program.regions[c].kind in _CALLS:
                        for v, x in zip(program.regions[c].invars, eqn.invars):
                            if isinstance(x, Literal) and v >= 0:
                                self.same[v] = _literal(x)

    def of(self, u: int) -> tuple:
        prog = self.prog
        for _ in range(256):
            if u in self.same:
                return self.same[u]
            p = prog.producer[u]
            if p < 0:
                return ("value", u)
            op = prog.ops[p]
            if not op.link or op.operands[0] < 0:
                return ("value", u)
            if op.primitive in (Link.CALL_IN, Link.CALL_OUT, Link.SCAN_CONST):
                u = op.operands[0]
            elif op.primitive == Link.SCAN_XS:
                stack = op.operands[0]
                made = prog.producer[stack]
                if made < 0 or prog.ops[made].primitive != Link.SCAN_YS:
                    return ("slice", stack)  # a stacked input: each body's slice of it
                u = prog.ops[made].operands[0]  # a forward body's output, stacked
            else:
                return ("value", u)
        return ("value", u)

    def alias(self, values, originals) -> None:
        """`values` are the same as `originals`, pairwise."""
        for w, v in zip(values, originals):
            if w >= 0 and v >= 0:
                self.same[w] = self.of(v)

    def key(self, op) -> tuple:
        args = []
        for u, x in zip(op.operands, op.eqn.invars):
            if isinstance(x, Literal):
                args.append(_literal(x))
            else:
                args.append(self.of(u))
        return (op.primitive, tuple(args))


@dataclass(frozen=True)
class Relaxation:
    """What reusing the values `reused` (reruns in user checkpoints) does: the ops of the
    checkpoint regions that no longer run (`skipped`: the reruns' own ops, and what only
    they read), and `reads`, recomputed value -> forward value, for each reused value a
    running op still reads (what the forward pass must keep for the backward pass)."""

    skipped: frozenset
    reads: dict


def relaxation(program, reused: frozenset) -> Relaxation:
    """The `Relaxation` of reusing `reused` (values `Partitioning.reuse` took)."""
    reruns = reruns_of(program)
    inside = set()
    for c in user_checkpoints(program):
        inside |= _inside(program, c.region)
    needed = [False] * len(program.values)
    for v in program.outputs:
        if v >= 0:
            needed[v] = True
    skipped = set()
    for op in reversed(program.ops):
        results = [r for r in op.results if r >= 0]
        if op.link:
            live = any(needed[r] for r in results)
        elif op.region in inside and results and all(r in reused or not needed[r] for r in results):
            skipped.add(op.id)
            continue
        else:
            live = True
        if live:
            for u in op.operands:
                if u >= 0:
                    needed[u] = True
    reads = {w: reruns[w] for w in sorted(reused) if needed[w]}
    return Relaxation(frozenset(skipped), reads)


def scan_body_of(program, region: int) -> int:
    """The scan body `region` is (or is inside, through calls and checkpoints), or -1."""
    while region >= 0 and program.regions[region].kind != "scan":
        region = program.regions[region].parent
    return region
