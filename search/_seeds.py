"""The macro actions the search offers, and the textbook plans it seeds with them.

Plans people write for a mesh give each axis one role: data parallel or FSDP over the
outer axes, tensor parallelism (with or without sequence parallelism) over one axis,
pipeline stages over another, context parallelism over one or more (their parameters
sharded too where the plan shards them over its data axes), and a rematerialization
policy for the whole. `compositions` lists every such assignment, so the search scores each of
them before its tree search begins, whatever a beam of macro sequences would have kept:
a search whose macro list grew (context parallelism) had crowded the four-tactic plan of
Llama-3 70B out of its beam and settled 13% above it.
"""

from __future__ import annotations

import itertools

import partir
from tactics import FSDP, ContextParallel, DataParallel, Megatron, Pipeline, Remat, SequenceParallel, ZeRO

#: The rematerialization policies the search may apply to every layer (`Remat`).
REMAT_MACROS = ("dots", "full")
#: The policies the search tries on its best plan alone, in place of its remat
#: (`search._refine.refine_remat`): those that keep some matmuls by role, and the one that
#: keeps the attention's output beside what 'dots' keeps (no fused kernel run again).
REMAT_REFINED = ("qkv", "dots_except_mlp_in", "dots_with_context")
#: The roles an axis may take once per plan (two tensor-parallel axes are moves of the
#: tree search, not textbook plans). Context parallelism may take several: one context
#: group over two mesh axes (a long sequence on few sequences a step, e.g. NeMo's
#: Llama 3.1 70B, one micro-batch of 2 sequences on 64 GPUs, splits its tokens 16 ways).
ONCE = ("tensor", "pipeline")
#: The role each macro tactic gives its axis in a composition.
ROLE = {DataParallel: "data", FSDP: "fsdp", Megatron: "tensor", ContextParallel: "context", Pipeline: "pipeline",
        ZeRO: "zero"}
#: The order a composition's tactics apply in, by role: the batch, then the sequence
#: (context parallelism must split the queries before sequence parallelism holds their
#: tokens over its own axis: the other way round it refuses, and every plan with both
#: was a dead end), then what splits weights by their blocks, FSDP last (it shards what
#: the others left whole), pipeline stages over the layer scan and remat over what all
#: of them made. ZeRO-1 shards the optimizer state of what the others left (it keeps a
#: Megatron's splits).
ORDER = ("data", "context", "tensor", "fsdp", "zero", "pipeline", "remat")
#: The circular schedule's repeats the search offers beside GPipe: 2 halves the bubble
#: of small microbatch counts; more repeats exchange the same weights for less bubble
#: still, at the price of a search twice as wide per count offered.
CIRCULAR_REPEATS = 2


def macros(part, axes, pipelines, *, ring: bool = False, zero: bool = False) -> tuple:
    """The tactics the search may apply as one action on `part`'s program: on each
    searched axis of more than one device data parallelism, Megatron, sequence
    parallelism and FSDP (with `zero`, ZeRO-1 too: `part` is detached for it,
    `search._zero_root`), context parallelism where there is self-attention (as a ring
    too with `ring`, for a plan the shard_map lowering runs), pipeline stages with each
    microbatch count of `pipelines` where there is a layer scan (GPipe, and the circular
    schedule and 1F1B where they can run: `_schedules`); and each remat policy where
    there are layers to recompute."""
    zero1 = (lambda a: (ZeRO(a, stage=1),)) if zero else (lambda a: ())
    out = tuple(m for a in _split(part, axes)
                for m in (DataParallel(a), Megatron(a), SequenceParallel(a), FSDP(a, leave_room=False), *zero1(a)))
    if partir.remat_layers(part.program):
        out += tuple(Remat(p) for p in REMAT_MACROS)
    out += context_macros(part, axes, ring=ring)
    scans = partir.layer_scans(part.program)
    if scans:
        out += tuple(Pipeline(a, m, schedule=s, repeats=r) for a in _split(part, axes) for m in pipelines
                     for s, r in _schedules(part, a, m, scans[0]))
    return out


def _schedules(part, axis: str, microbatches: int, scans) -> tuple[tuple[str, int], ...]:
    """The (schedule, repeats) the search offers a pipeline of layer scans `scans` over
    `axis` with: GPipe; the circular schedule's `CIRCULAR_REPEATS` where it can run (a
    layer at least in each of the S*R chunks, unequal ones padded, at least a
    microbatch per stage); and 1F1B where it keeps fewer residuals than GPipe (more
    microbatches than the 2S-1 a stage keeps in flight) and the step differentiates
    the layers where it scans them (a backward scan in the forward's region, the head
    between them); interleaved 1F1B (`CIRCULAR_REPEATS` chunks a stage,
    `partir.OnefSchedule`) on the same terms, where every chunk has a layer, the
    microbatches are whole groups of S, and it too keeps fewer units than GPipe (more
    than its ring's (R+1)S-1: `_keeps_fewer`). Each runs with every remat policy
    (`compositions` pairs them; 1F1B's ring then keeps what recomputing needs)."""
    stages = part.mesh.size(axis)
    out = [("gpipe", 1)]
    r = CIRCULAR_REPEATS
    chunks = stages * r <= scans.forward.length
    if chunks and microbatches >= stages:
        out.append(("gpipe", r))
    back = scans.backward
    onef = back is not None and back.parent == scans.forward.parent
    if onef and _keeps_fewer(stages, 1, microbatches):
        out.append(("1f1b", 1))
    if onef and chunks and microbatches % stages == 0 and _keeps_fewer(stages, r, microbatches):
        out.append(("1f1b", r))
    return tuple(out)


def _keeps_fewer(stages: int, repeats: int, microbatches: int) -> bool:
    """Whether 1F1B of `repeats` chunks a stage keeps fewer units in flight (its ring,
    `partir.OnefSchedule`) than GPipe, which keeps all of them."""
    sched = partir.OnefSchedule(stages, repeats, microbatches)
    return sched.ring < sched.units


def compositions(offered) -> tuple[tuple, ...]:
    """Every plan that gives each searched axis at most one role, built from the macro
    tactics `offered` (`macros`): per axis nothing, data parallelism, FSDP, Megatron
    with or without sequence parallelism, context parallelism (each balance) or
    pipeline stages (each microbatch count), tensor and pipeline roles on one axis
    each (`ONCE`), then each remat policy offered or none; where a plan has an FSDP
    role, FSDP on its context axes too (`_sharded_context`). Plans of fewer than three
    tactics are left out (the search seeds every pair anyway); the tactics of each
    apply in `ORDER`. ZeRO-1 (where offered) is a data-parallel role with the optimizer
    state sharded, and shards over the plan's context axes too, as Megatron's
    distributed optimizer does over its data and context ranks (where the plan has no
    FSDP role, which shards them already)."""
    axes = dict.fromkeys(m.axis for m in offered if not isinstance(m, Remat))
    by_axis = [[(), *_roles(a, offered)] for a in axes]
    remats = [()] + [(("remat", m),) for m in offered if isinstance(m, Remat)]
    fsdp = {m.axis: m for m in offered if isinstance(m, FSDP)}
    zero = {m.axis: m for m in offered if isinstance(m, ZeRO)}
    out = []
    for per_axis in itertools.product(*by_axis):
        kinds = [k for role in per_axis for k, _ in role[:1]]
        if any(kinds.count(k) > 1 for k in ONCE):
            continue
        kept = {k for role in per_axis for k, _ in role}
        sharded = _sharded_context(per_axis, fsdp, "fsdp") if "fsdp" in kept else \
            _sharded_context(per_axis, zero, "zero") if "zero" in kept else ()
        for remat in remats:
            plan = sorted((t for role in (*per_axis, sharded, remat) for t in role), key=lambda t: ORDER.index(t[0]))
            if len(plan) >= 3:
                out.append(tuple(tactic for _, tactic in plan))
    return tuple(out)


def _sharded_context(per_axis, sharding: dict, kind: str) -> tuple:
    """The `kind` roles ('fsdp' or 'zero') a plan with such a role adds on its context
    axes (`sharding`: the macro of that kind offered per axis): the parameters (FSDP) or
    the optimizer state (ZeRO-1) sharded over every axis that splits the tokens, the
    batch or the sequence, as Megatron's distributed optimizer shards over its data and
    context ranks and MaxText's FSDP over its context axis."""
    return tuple((kind, sharding[t.axis]) for role in per_axis for k, t in role[:1]
                 if k == "context" and t.axis in sharding)


def variant_key(tactic) -> tuple:
    """What a macro's variants share: its axis and role (`ROLE`; a remat policy's is
    the plan's remat), so that context parallelism's strategies and balances, or a
    pipeline's microbatch counts and repeats, are variants of one role on an axis."""
    if isinstance(tactic, Remat):
        return ("remat",)
    return (getattr(tactic, "axis", None), ROLE.get(type(tactic), type(tactic).__name__))


def primary_first(seeds, score) -> tuple:
    """`seeds` reordered: first the plans whose every tactic is the best variant of its
    role on its axis (highest `score(tactic)`, ties to the first offered), then the
    rest, each part in its own order. A mesh of four axes offers tens of thousands of
    compositions (roles^axes, times every variant), more than a time budget scores;
    choosing each role's variant by how it did alone first means the budget goes to
    different role assignments before it goes to variants of one."""
    rank = variant_ranks(seeds, score)
    first = [seq for seq in seeds if not any(rank[t] for t in seq)]
    return (*first, *(seq for seq in seeds if any(rank[t] for t in seq)))


def variant_ranks(seeds, score) -> dict:
    """Each tactic of `seeds` -> its rank among the variants of its role on its axis
    (`variant_key`) by `score(tactic)`, best 0 (ties to the first offered)."""
    variants: dict = {}
    for t in dict.fromkeys(t for seq in seeds for t in seq):
        variants.setdefault(variant_key(t), []).append(t)
    return {t: i for ts in variants.values() for i, t in enumerate(sorted(ts, key=score, reverse=True))}


#: The roles an assignment of roles to axes tells apart (`skeletons`): ZeRO-1 is a way to
#: run data parallelism and sequence parallelism a way to run Megatron, on the same axis.
COARSE = {"zero": "data", "SequenceParallel": "tensor"}
#: The way to run a role that `skeletons` tries first: the inverse of `COARSE`.
ADD_ON = {role: way for way, role in COARSE.items()}


def skeletons(seeds, score, axes) -> tuple[tuple[tuple, ...], ...]:
    """`seeds` grouped by the role each gives each axis (`variant_key`, `COARSE`), a
    remat policy being a variant too: one group per assignment of roles to axes. Each
    group's variants run from the likeliest best: by the sum of their tactics' ranks
    (`variant_ranks`), plus one for each data role without ZeRO-1 and each Megatron
    without sequence parallelism (each saves memory at no time to speak of, as the plans
    run at scale have them), then by the rank of their remat policy (none first). The
    groups that give every axis of `axes` a role come first, then the others, each in
    the order of its first seed: a plan that leaves an axis idle computes its work again
    there. The search scores one variant of each group before a second of any
    (`TreeSearch.seed_skeleton`): four axes offer thousands of variants of hundreds of
    assignments, and which variant applies depends on the others (a pipeline's
    microbatch count must divide the batch the data roles leave it)."""
    rank = variant_ranks(seeds, score)
    groups: dict = {}
    for seq in seeds:
        groups.setdefault(frozenset(map(_coarse, unrematerialized(seq))), []).append(seq)
    everywhere = set(axes)

    def idle(key) -> bool:
        return not everywhere <= {axis for axis, _ in key}

    def likeliest(seq) -> tuple:
        kept = unrematerialized(seq)
        roles = {variant_key(t) for t in kept}
        bare = sum((axis, ADD_ON[role]) not in roles for axis, role in set(map(_coarse, kept)) if role in ADD_ON)
        return sum(rank[t] for t in kept) + bare, sum(rank[t] + 1 for t in seq if isinstance(t, Remat))

    return tuple(tuple(sorted(g, key=likeliest)) for _, g in sorted(groups.items(), key=lambda kg: idle(kg[0])))


def unrematerialized(seq) -> tuple:
    """The tactics of `seq` but its remat policy."""
    return tuple(t for t in seq if not isinstance(t, Remat))


def _coarse(tactic) -> tuple:
    axis, role = variant_key(tactic)
    return axis, COARSE.get(role, role)


def dead_end(seq, dead) -> bool:
    """Whether the tactics `seq` begin with a sequence in `dead`, one whose last tactic
    did not apply after the others: seeding `seq` would stop there and score that
    state again (the states a sequence reaches are its own, whatever came before)."""
    return stuck_at(seq, dead) is not None


def stuck_at(seq, dead):
    """The tactic of `seq` that ends its first prefix in `dead` (the one that did not
    apply after those before it), or None where `seq` is no `dead_end`."""
    return next((seq[k - 1] for k in range(1, len(seq) + 1) if seq[:k] in dead), None)


def _roles(axis, offered) -> list[tuple]:
    """The roles `axis` may take among the `offered` macros, each a tuple of
    `(kind, tactic)` pairs: one per macro on it (`ROLE`), and Megatron with sequence
    parallelism after it, and ZeRO-1 after data parallelism (it shards the optimizer
    state of a batch split over the axis)."""
    mine = [m for m in offered if getattr(m, "axis", None) == axis]
    out = []
    for m in mine:
        kind = ROLE.get(type(m))
        if kind is None:
            continue  # sequence parallelism: a role only beside its Megatron
        if isinstance(m, ZeRO):
            out += [(("data", d), (kind, m)) for d in mine if isinstance(d, DataParallel)]
            continue
        out.append(((kind, m),))
        if isinstance(m, Megatron):
            out += [((kind, m), (kind, s)) for s in mine if isinstance(s, SequenceParallel)]
    return out


def context_macros(part, axes, *, ring: bool = False) -> tuple:
    """Context parallelism on each axis, where the program has self-attention: in the
    original token order, and balanced ('zigzag') where a causal attention's work
    depends on it and the program permits the permutation; each with the keys and
    values all-gathered, and with `ring` also ringed."""
    found = partir.attentions(part.program)
    if not found:
        return ()
    balance = [None]
    if any(a.masked for a in found):
        classes = partir.dim_classes(part.program)
        try:
            partir.order_sites(part.program, classes.label(found[0].key, found[0].key_dim))
            balance.append("zigzag")
        except partir.PartitioningError:
            pass  # an op that does not commute with a permutation: the original order only
    strategies = ("allgather", "ring") if ring else ("allgather",)
    return tuple(ContextParallel(a, strategy=s, balance=b) for a in _split(part, axes) for s in strategies
                 for b in balance)


def _split(part, axes) -> list[str]:
    """The searched axes of more than one device."""
    return [a for a in axes if part.mesh.size(a) > 1]
