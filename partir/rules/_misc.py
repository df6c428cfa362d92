"""Sorting, windows (pooling and its gradients), random numbers, and the ops that run
whole: host callbacks, stateful generators, solves through user-given jaxprs."""

from __future__ import annotations

from .._rule import factor_rule
from ._elementwise import elementwise
from ._registry import Namer, conservative_rule, register
from ._traits import OPAQUE, Traits, Work

WINDOWED = ["reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
            "select_and_scatter_add", "select_and_gather_add", "select_and_scatter"]
#: Pooling counts (window - 1) flops per result element; its gradients 7.5 per source
#: and window element (measured on a 2x2 max-pool gradient); the generic select and
#: scatter none.
WINDOW_TRAITS = {**{p: Traits(Work.WINDOW) for p in WINDOWED[:4]},
                 "select_and_scatter_add": Traits(Work.WINDOW_GRAD), "select_and_gather_add": Traits(Work.WINDOW_GRAD),
                 "select_and_scatter": OPAQUE}


@register(*WINDOWED, traits=WINDOW_TRAITS)
def windowed(in_shapes, out_shapes, params):
    """Dims with a trivial window (size 1, stride 1, no padding or dilation) are shared by
    every value; windowed dims are blocked (no halo exchange): `([i, j]) -> ([i, k]) blocked={j, k}`."""
    rank = len(params["window_dimensions"])
    ones = (1,) * rank
    pads = params.get("padding") or ((0, 0),) * rank
    base = params.get("base_dilation") or ones
    wdil = params.get("window_dilation") or ones
    trivial = [
        params["window_dimensions"][d] == 1 and params["window_strides"][d] == 1
        and tuple(pads[d]) == (0, 0) and base[d] == 1 and wdil[d] == 1
        for d in range(rank)
    ]
    name = Namer()
    blocked = []

    def spec(key, shape):
        if len(shape) != rank:  # init values of the generic reduce_window are scalars
            return [name((key, d)) for d in range(len(shape))]
        v = [name(d) if trivial[d] else name((key, d)) for d in range(rank)]
        blocked.extend(v[d] for d in range(rank) if not trivial[d])
        return v

    ins = [spec(("in", k), s) for k, s in enumerate(in_shapes)]
    outs = [spec(("out", k), s) for k, s in enumerate(out_shapes)]
    return factor_rule(ins, outs, in_shapes, out_shapes, blocked=blocked)


@register("sort", traits=Traits(Work.SCAN))
def sort(in_shapes, out_shapes, params):
    """All operands (keys and payloads) share factors; the sorted dim is blocked."""
    name = Namer()
    dims = [name(d) for d in range(len(in_shapes[0]))]
    return factor_rule([dims] * len(in_shapes), [dims] * len(out_shapes), in_shapes, out_shapes,
                       blocked=[dims[params["dimension"]]])


@register("top_k", "approx_top_k", traits=OPAQUE)
def top_k(in_shapes, out_shapes, params):
    """Every dim blocked: `([i, j]) -> ([k, l], [k, l]) blocked={i, j, k, l}`. Mathematically
    the leading dims could pass through, but XLA's SPMD partitioner replicates the TopK
    custom call it lowers to (it all-gathers the operand), so a split here would be a
    promise the lowering does not keep; the plan reshards around it instead."""
    name = Namer()
    rank = len(in_shapes[0])
    ins = [name(("in", d)) for d in range(rank)]
    out = [name(("out", d)) for d in range(rank)]
    return factor_rule([ins], [out] * len(out_shapes), in_shapes, out_shapes, blocked=ins + out)


@register("random_bits", "random_split", traits=OPAQUE)
def random_expand(in_shapes, out_shapes, params):
    """The key array's dims lead the result; the generated dims are free to split
    (JAX's partitionable threefry makes bits independent of the layout)."""
    name = Namer()
    key = [name(d) for d in range(len(in_shapes[0]))]
    out = key + [name(("new", d)) for d in range(len(out_shapes[0]) - len(key))]
    return factor_rule([key], [out], in_shapes, out_shapes)


@register("random_seed", "random_fold_in", "random_clone", "random_gamma", traits=OPAQUE)
def random_elementwise(in_shapes, out_shapes, params):
    """Seeds (and folded-in data) map one-to-one to keys, keys to keys (a clone), keys and
    shape parameters to gamma samples."""
    name = Namer()
    out = [name(d) for d in range(len(out_shapes[0]))]
    ins = [out if len(s) == len(out) else [name(("x", k, d)) for d in range(len(s))] for k, s in enumerate(in_shapes)]
    return factor_rule(ins, [out], in_shapes, out_shapes)


@register("random_wrap", "random_unwrap", traits=OPAQUE)
def random_wrap(in_shapes, out_shapes, params):
    """Raw key data carries a trailing key-word dim that the typed key array does not."""
    name = Namer()
    (a,), (b,) = in_shapes, out_shapes
    shared = [name(d) for d in range(min(len(a), len(b)))]
    word = name("word")
    ins = shared + [word] * (len(a) - len(shared))
    outs = shared + [word] * (len(b) - len(shared))
    return factor_rule([ins], [outs], in_shapes, out_shapes, blocked=[word])


@register("pure_callback", "io_callback", "debug_callback", "debug_print", traits=OPAQUE)
def host_callback(in_shapes, out_shapes, params):
    """Every dim blocked: a host callback sees whole arrays, so its operands are gathered
    and its results made whole on every device (whatever sharding the callback asks)."""
    return conservative_rule(in_shapes, out_shapes)


@register("rng_bit_generator", "rng_uniform", traits=OPAQUE)
def stateful_random(in_shapes, out_shapes, params):
    """Every dim blocked: XLA's generators (RngBitGenerator, stateful RngUniform) draw a
    stream whose values depend on the whole output shape, so each device draws it whole
    (JAX's `jax.random` threefry keys are the partitionable way)."""
    return conservative_rule(in_shapes, out_shapes)


@register("custom_linear_solve", traits=OPAQUE)
def custom_linear_solve(in_shapes, out_shapes, params):
    """Every dim blocked: the solve runs through the user's `matvec` and `solve` jaxprs,
    which lift does not enter, so it runs whole on every device."""
    return conservative_rule(in_shapes, out_shapes)


@register("dce_sink", traits=OPAQUE)
def sink(in_shapes, out_shapes, params):
    """Keeps values alive and computes nothing: they stay in whatever layout they have
    (their factors have no result to make partial)."""
    name = Namer()
    return factor_rule([[name((k, d)) for d in range(len(s))] for k, s in enumerate(in_shapes)], [], in_shapes,
                       out_shapes)


#: JAX's hi-level primitives (`call_hi_primitive`, JAX 0.12), by the class of the
#: primitive they wrap: elementwise ones, and ones whose every output depends on the
#: whole input (the positions of the nonzeros of a mask).
ELEMENTWISE_HI = ("Frexp", "Ldexp")
WHOLE_HI = ("Nonzero",)


@register("call_hi_primitive", traits=OPAQUE)
def call_hi_primitive(in_shapes, out_shapes, params):
    """Ruled by the primitive it wraps: elementwise ones (frexp, ldexp) as `elementwise`;
    a search of queries in a sorted array (`jnp.searchsorted`) as the queries'
    elementwise map over the whole sorted array: `([i], [j, k]) -> ([j, k]) blocked={i}`;
    `jnp.nonzero` with every dim blocked. Any other raises, so that lift replicates it
    and says which."""
    prim = params["_prim"]
    kind = type(prim).__name__
    if kind in ELEMENTWISE_HI:
        return elementwise(in_shapes, out_shapes, params)
    if kind in WHOLE_HI:
        return conservative_rule(in_shapes, out_shapes)
    (arr, query), (out,) = in_shapes, out_shapes
    if kind == "SearchSorted" and len(arr) == prim.batch_dims + 1 and out == query:
        name = Namer()
        dims = [name(d) for d in range(len(query))]
        searched = name("searched")
        return factor_rule([dims[:prim.batch_dims] + [searched], dims], [dims], in_shapes, out_shapes,
                           blocked=[searched])
    raise NotImplementedError(f"no rule for the hi-level primitive {kind}")
