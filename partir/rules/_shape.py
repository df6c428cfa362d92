"""Shape ops: broadcasts, reshapes, transposes, slices, pads, concatenations."""

from __future__ import annotations

import dataclasses
import math

from .._rule import factor_rule
from ._registry import Namer, register
from ._traits import MOVE_FUSED, OPAQUE, VIEW, Fusion, Traits, Work


def _same_except(in_shapes, out_shapes, changed_in, changed_out, *, shared_extra=()):
    """Operand 0 and result 0 share the factor of each dim not listed as changed; changed
    dims get their own blocked factors. Further operands are scalars or listed in
    `shared_extra` (operand index -> same rule as operand 0)."""
    name = Namer()
    a, out = in_shapes[0], out_shapes[0]
    ins0 = [name(("d", d)) if d not in changed_in else name(("a", d)) for d in range(len(a))]
    res = [name(("d", d)) if d not in changed_out else name(("b", d)) for d in range(len(out))]
    blocked = [ins0[d] for d in changed_in] + [res[d] for d in changed_out]
    ins = [ins0]
    for k, s in enumerate(in_shapes[1:], start=1):
        if k in shared_extra:
            ins.append([ins0[d] if s[d] == a[d] else name(("e", k, d)) for d in range(len(s))])
            blocked += [ins[-1][d] for d in range(len(s)) if s[d] != a[d]]
        else:
            ins.append([name(("s", k, d)) for d in range(len(s))])
    return factor_rule(ins, [res] * len(out_shapes), in_shapes, out_shapes, blocked=blocked)


@register("broadcast_in_dim", traits=Traits(Work.MOVE, Fusion.CONSUMER, creates=True))
def broadcast_in_dim(in_shapes, out_shapes, params):
    """Operand dims map to `broadcast_dimensions`; new and size-1-expanded result dims get
    factors of their own, free to split: `([j]) -> ([i, j])`."""
    name = Namer()
    (a,), (out,) = in_shapes[:1], out_shapes
    res = [name(("r", d)) for d in range(len(out))]
    ins = []
    for d, r in enumerate(params["broadcast_dimensions"]):
        ins.append(res[r] if a[d] == out[r] else name(("a", d)))
    extra = [[name(("x", k, d)) for d in range(len(s))] for k, s in enumerate(in_shapes[1:])]
    return factor_rule([ins, *extra], [res], in_shapes, out_shapes)


def reshape_factors(a, b):
    """Factor a reshape from shape `a` to shape `b`: (factors of each dim of a, of b,
    factor sizes, blocked factors). Dims are grouped where running products agree; a
    group whose dims share no common divisor structure (e.g. [6, 4] -> [4, 6]) is opaque:
    its dims get blocked factors of their own."""
    name = Namer()
    fa = [[] for _ in a]
    fb = [[] for _ in b]
    sizes, blocked = {}, []

    def fresh(n):
        f = name.fresh()
        sizes[f] = n
        return f

    ia = [d for d in range(len(a)) if a[d] != 1]
    ib = [d for d in range(len(b)) if b[d] != 1]
    for d in range(len(a)):
        if a[d] == 1:
            fa[d].append(fresh(1))
    for d in range(len(b)):
        if b[d] == 1:
            fb[d].append(fresh(1))
    i = j = 0
    while i < len(ia) and j < len(ib):
        # Collect one group: the shortest runs of dims whose products agree.
        ga, gb = [ia[i]], [ib[j]]
        pa, pb = a[ia[i]], b[ib[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(ia[i]); pa *= a[ia[i]]; i += 1
            else:
                gb.append(ib[j]); pb *= b[ib[j]]; j += 1
        plan = _split_group([a[d] for d in ga], [b[d] for d in gb])
        if plan is None:
            for d in ga:
                f = fresh(a[d]); fa[d].append(f); blocked.append(f)
            for d in gb:
                f = fresh(b[d]); fb[d].append(f); blocked.append(f)
            continue
        for k, (ka, kb) in enumerate(plan):
            f = fresh(ka[2])
            fa[ga[ka[0]]].append(f)
            fb[gb[kb[0]]].append(f)
    # Size-0 shapes leave dims unmatched: block them.
    for dims, shape, idx in ((fa, a, ia[i:]), (fb, b, ib[j:])):
        for d in idx:
            f = fresh(shape[d]); dims[d].append(f); blocked.append(f)
    return fa, fb, sizes, blocked


def _split_group(ga, gb):
    # Walk both runs of dims splitting off common factors, major first. Returns a list of
    # ((dim in a, -, size), (dim in b, -, size)) or None when no clean split exists.
    plan = []
    i = j = 0
    ra, rb = ga[0], gb[0]
    while True:
        g = ra if rb % ra == 0 else rb if ra % rb == 0 else math.gcd(ra, rb)
        if g == 1:
            return None
        plan.append(((i, 0, g), (j, 0, g)))
        ra //= g
        rb //= g
        if ra == 1:
            i += 1
            if i < len(ga):
                ra = ga[i]
        if rb == 1:
            j += 1
            if j < len(gb):
                rb = gb[j]
        if i == len(ga) or j == len(gb):
            return plan if i == len(ga) and j == len(gb) else None


@register("reshape", traits=VIEW)
def reshape(in_shapes, out_shapes, params):
    """Split and merged dims share factors: `([i*j, k]) -> ([i, j, k])`."""
    a, b = in_shapes[0], out_shapes[0]
    if params.get("dimensions") is not None:
        return _same_except(in_shapes, out_shapes, range(len(a)), range(len(b)))
    fa, fb, sizes, blocked = reshape_factors(a, b)
    extra = [[f"s{k}_{d}" for d in range(len(s))] for k, s in enumerate(in_shapes[1:])]
    return factor_rule([fa, *extra], [fb], in_shapes, out_shapes, sizes=sizes, blocked=blocked)


@register("transpose", traits=MOVE_FUSED)
def transpose(in_shapes, out_shapes, params):
    """Result dim d is operand dim `permutation[d]`: `([i, j]) -> ([j, i])`."""
    name = Namer()
    ins = [name(d) for d in range(len(in_shapes[0]))]
    return factor_rule([ins], [[ins[p] for p in params["permutation"]]], in_shapes, out_shapes)


@register("squeeze", traits=VIEW)
def squeeze(in_shapes, out_shapes, params):
    """Removed size-1 dims have factors of their own: `([i, j]) -> ([i])`."""
    name = Namer()
    gone = {d % len(in_shapes[0]) for d in params["dimensions"]}
    ins = [name(d) for d in range(len(in_shapes[0]))]
    return factor_rule([ins], [[f for d, f in enumerate(ins) if d not in gone]], in_shapes, out_shapes)


@register("concatenate", traits=MOVE_FUSED)
def concatenate(in_shapes, out_shapes, params):
    """Other dims are shared; the concatenated dim is blocked in every value."""
    name = Namer()
    c = params["dimension"]
    ins = [[name(("c", k)) if d == c else name(d) for d in range(len(s))] for k, s in enumerate(in_shapes)]
    out = [name("out") if d == c else name(d) for d in range(len(out_shapes[0]))]
    blocked = [v[c] for v in ins] + [out[c]]
    return factor_rule(ins, [out], in_shapes, out_shapes, blocked=blocked)


@register("pad", traits=MOVE_FUSED)
def pad(in_shapes, out_shapes, params):
    """Unpadded dims are shared, padded dims blocked; the padding value is a scalar."""
    changed = [d for d, cfg in enumerate(params["padding_config"]) if tuple(cfg) != (0, 0, 0)]
    return _same_except(in_shapes, out_shapes, changed, changed)


@register("slice", traits=MOVE_FUSED)
def slice_(in_shapes, out_shapes, params):
    """Dims taken whole are shared, sliced dims blocked: `([i, j]) -> ([i, k]) blocked={j, k}`."""
    a = in_shapes[0]
    strides = params.get("strides") or (1,) * len(a)
    changed = [
        d
        for d in range(len(a))
        if (params["start_indices"][d], params["limit_indices"][d], strides[d]) != (0, a[d], 1)
    ]
    return _same_except(in_shapes, out_shapes, changed, changed)


@register("dynamic_slice", traits=OPAQUE)
def dynamic_slice(in_shapes, out_shapes, params):
    """Dims taken whole are shared, sliced dims blocked; start indices are scalars."""
    a = in_shapes[0]
    changed = [d for d in range(len(a)) if params["slice_sizes"][d] != a[d]]
    return _same_except(in_shapes, out_shapes, changed, changed)


@register("dynamic_update_slice", traits=OPAQUE)
def dynamic_update_slice(in_shapes, out_shapes, params):
    """Operand and result share every dim; the update shares the dims it covers whole.
    Dims it covers in part are blocked in all three."""
    a, u = in_shapes[0], in_shapes[1]
    changed = [d for d in range(len(a)) if u[d] != a[d]]
    rule = _same_except(in_shapes, out_shapes, [], [], shared_extra=(1,))
    if not changed:
        return rule
    # Block the operand/result factor of partly-updated dims too.
    blocked = set(rule.blocked) | {rule.operands[0][d][0] for d in changed}
    return dataclasses.replace(rule, blocked=tuple(sorted(blocked)))


@register("rev", traits=MOVE_FUSED)
def rev(in_shapes, out_shapes, params):
    """Reversed dims are blocked (reversing a split dim would swap blocks between devices)."""
    name = Namer()
    ins = [name(d) for d in range(len(in_shapes[0]))]
    return factor_rule([ins], [ins], in_shapes, out_shapes, blocked=[ins[d] for d in params["dimensions"]])


@register("split", traits=OPAQUE)
def split(in_shapes, out_shapes, params):
    """Other dims are shared; the split dim is blocked in every value."""
    name = Namer()
    ax = params["axis"]
    ins = [name(("in", d)) if d == ax else name(d) for d in range(len(in_shapes[0]))]
    outs = [[name(("out", k)) if d == ax else name(d) for d in range(len(s))] for k, s in enumerate(out_shapes)]
    return factor_rule([ins], outs, in_shapes, out_shapes, blocked=[ins[ax]] + [o[ax] for o in outs])


@register("stack", traits=OPAQUE)
def stack(in_shapes, out_shapes, params):
    """Operands share their dims with the result's other dims; the new dim they are
    stacked along is blocked: `([i, j], [i, j]) -> ([i, j, k]) blocked={k}`."""
    name = Namer()
    ax = params["axis"]
    dims = [name(d) for d in range(len(in_shapes[0]))]
    new = name("new")
    return factor_rule([dims] * len(in_shapes), [dims[:ax] + [new] + dims[ax:]], in_shapes, out_shapes, blocked=[new])


@register("unstack", traits=OPAQUE)
def unstack(in_shapes, out_shapes, params):
    """The inverse of `stack`: the dim taken apart is blocked, the others pass to every
    result: `([i, j]) -> ([j], [j]) blocked={i}`."""
    name = Namer()
    ax = params["axis"]
    dims = [name(d) for d in range(len(in_shapes[0]))]
    rest = dims[:ax] + dims[ax + 1:]
    return factor_rule([dims], [rest] * len(out_shapes), in_shapes, out_shapes, blocked=[dims[ax]])


@register("tile", traits=OPAQUE)
def tile(in_shapes, out_shapes, params):
    """Result dim d is `reps[d]` copies of operand dim d, the copies major: the operand's
    factor is shared and the copies are a factor of the result alone, free to split
    (each device makes its own copies): `([i, j]) -> ([k*i, l*j])`."""
    name = Namer()
    (a,), reps = in_shapes, params["reps"]
    ins = [name(("a", d)) for d in range(len(a))]
    outs, sizes = [], {f: n for f, n in zip(ins, a)}
    for d, f in enumerate(ins):
        if reps[d] == 1:
            outs.append([f])
        else:
            copies = name(("copies", d))
            sizes[copies] = reps[d]
            outs.append([copies, f])
    return factor_rule([ins], [outs], in_shapes, out_shapes, sizes=sizes)


@register("iota", "empty", "empty2", "platform_index", "create_token",
          traits={"iota": Traits(Work.MOVE, creates=True), "empty": Traits(Work.MOVE, creates=True),
                  "empty2": Traits(Work.MOVE, creates=True), "platform_index": OPAQUE, "create_token": OPAQUE})
def creation(in_shapes, out_shapes, params):
    """No array operands (an iota, an empty buffer, which platform runs, a token): every
    result dim is free to split (each device makes its own block): `() -> ([i, j])`."""
    name = Namer()
    ins = [[name(("in", k, d)) for d in range(len(s))] for k, s in enumerate(in_shapes)]
    return factor_rule(ins, [[name(d) for d in range(len(s))] for s in out_shapes], in_shapes, out_shapes)
