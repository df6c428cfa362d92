"""Golden strings of the factor rule of every primitive family, from real jaxprs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partir.rules import get_rule

X = jnp.ones((4, 6))
I23 = jnp.ones((2, 3), jnp.int32)
B = jnp.ones((3, 4, 4))  # a batch of matrices


def _rule(fn, *args, prim):
    """The printed rule of the first `prim` equation in fn's jaxpr (through jit calls)."""

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "jit":
                found = walk(e.params["jaxpr"].jaxpr)
                if found:
                    return found
            elif e.primitive.name == prim:
                ins = tuple(tuple(getattr(v.aval, "shape", ())) for v in e.invars)
                outs = tuple(tuple(v.aval.shape) for v in e.outvars)
                return str(get_rule(prim)(ins, outs, e.params))
        return None

    found = walk(jax.make_jaxpr(fn)(*args).jaxpr)
    assert found is not None, f"no {prim} in the jaxpr"
    return found


CASES = [
    # contractions
    ("matmul", lambda a, b: a @ b, (X, jnp.ones((6, 8))), "dot_general",
     "([i, j], [j, k]) -> ([i, k]) reduction={j}"),
    ("batched matmul", lambda a, b: jnp.einsum("bij,bjk->bik", a, b), (jnp.ones((2, 4, 6)), jnp.ones((2, 6, 8))),
     "dot_general", "([i, j, k], [i, k, l]) -> ([i, j, l]) reduction={k}"),
    ("attention scores", lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k), (jnp.ones((2, 4, 8, 16)),) * 2,
     "dot_general", "([i, j, k, l], [i, m, k, l]) -> ([i, k, j, m]) reduction={l}"),
    ("conv NHWC", lambda a, w: jax.lax.conv_general_dilated(a, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
     (jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 8))), "conv_general_dilated",
     "([i, j, k, l], [m, n, l, p]) -> ([i, r, s, p]) reduction={l} blocked={j, k, m, n, r, s}"),
    # elementwise
    ("add scalar", lambda a: a + 1.0, (X,), "add", "([i, j], []) -> ([i, j])"),
    ("select_n", lambda a: jnp.where(a > 0, a, 0.0), (X,), "select_n", "([i, j], [i, j], [i, j]) -> ([i, j])"),
    ("compare", lambda a: a > 0, (X,), "gt", "([i, j], []) -> ([i, j])"),
    ("convert", lambda a: a.astype(jnp.bfloat16), (X,), "convert_element_type", "([i, j]) -> ([i, j])"),
    ("bitcast narrower", lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16), (X,), "bitcast_convert_type",
     "([i, j]) -> ([i, j, k]) blocked={k}"),
    # reductions and scans
    ("reduce_sum", lambda a: a.sum(1), (X,), "reduce_sum", "([i, j]) -> ([i]) reduction={j}"),
    ("reduce_max", lambda a: a.max(0), (X,), "reduce_max", "([i, j]) -> ([j]) reduction max={i}"),
    ("argmax", lambda a: a.argmax(1), (X,), "argmax", "([i, j]) -> ([i]) blocked={j}"),
    ("cumsum", lambda a: jnp.cumsum(a, 0), (X,), "cumsum", "([i, j]) -> ([i, j]) blocked={i}"),
    # shapes
    ("broadcast", lambda a: jnp.broadcast_to(a[:, None, :], (4, 3, 6)), (X,), "broadcast_in_dim",
     "([i, k]) -> ([i, j, k])"),
    ("reshape split", lambda a: a.reshape(2, 2, 6), (X,), "reshape", "([i*j, k]) -> ([i, j, k])"),
    ("reshape merge", lambda a: a.reshape(24), (X,), "reshape", "([i, j]) -> ([i*j])"),
    ("reshape heads", lambda a: a.reshape(2, 4, 8, 4), (jnp.ones((2, 4, 32)),), "reshape",
     "([i, j, k*l]) -> ([i, j, k, l])"),
    ("reshape opaque", lambda a: a.reshape(6, 4), (X,), "reshape", "([i, j]) -> ([k, l]) blocked={i, j, k, l}"),
    ("transpose", lambda a: a.T, (X,), "transpose", "([i, j]) -> ([j, i])"),
    ("squeeze", lambda a: a[:, 0:1].squeeze(1), (X,), "squeeze", "([i, j]) -> ([i])"),
    ("concatenate", lambda a: jnp.concatenate([a, a], 1), (X,), "concatenate",
     "([i, j], [i, k]) -> ([i, l]) blocked={j, k, l}"),
    ("pad", lambda a: jnp.pad(a, ((0, 0), (1, 1))), (X,), "pad", "([i, j], []) -> ([i, k]) blocked={j, k}"),
    ("slice", lambda a: a[:, 1:3], (X,), "slice", "([i, j]) -> ([i, k]) blocked={j, k}"),
    ("dynamic_slice", lambda a, i: jax.lax.dynamic_slice(a, (0, i), (4, 2)), (X, 1), "dynamic_slice",
     "([i, j], [], []) -> ([i, k]) blocked={j, k}"),
    ("dynamic_update_slice", lambda a, u, i: jax.lax.dynamic_update_slice(a, u, (0, i)), (X, jnp.ones((4, 2)), 1),
     "dynamic_update_slice", "([i, j], [i, k], [], []) -> ([i, j]) blocked={j, k}"),
    ("rev", lambda a: a[:, ::-1], (X,), "rev", "([i, j]) -> ([i, j]) blocked={j}"),
    ("split", lambda a: jnp.split(a, 2, 1), (X,), "split", "([i, j]) -> ([i, k], [i, l]) blocked={j, k, l}"),
    ("stack", lambda a: jnp.stack([a, a], 1), (X,), "stack", "([i, j], [i, j]) -> ([i, k, j]) blocked={k}"),
    ("unstack", lambda a: jnp.unstack(a[:, :2], axis=1), (X,), "unstack", "([i, j]) -> ([i], [i]) blocked={j}"),
    ("iota", lambda: jax.lax.broadcasted_iota(jnp.int32, (4, 6), 1), (), "iota", "() -> ([i, j])"),
    # indexing
    ("embedding lookup", lambda t, i: t[i], (jnp.ones((10, 6)), I23), "gather",
     "([i, j], [k, l, m]) -> ([k, l, j]) reduction={i} blocked={m}"),
    ("take_along_axis", lambda a, i: jnp.take_along_axis(a, i[..., None], -1), (jnp.ones((2, 3, 10)), I23), "gather",
     "([l, m, k], [l, m, n, o]) -> ([l, m, n]) reduction={k} blocked={o}"),
    ("lookup under vmap", lambda t, i: jax.vmap(lambda j: t[j])(i), (jnp.ones((10, 6)), jnp.ones(3, jnp.int32)),
     "gather", "([i, j], [k, l]) -> ([k, m, j]) reduction={i} blocked={l}"),
    ("lookup gradient under vmap", lambda t, i: jax.grad(lambda t: jax.vmap(lambda j: t[j])(i).sum())(t),
     (jnp.ones((10, 6)), jnp.ones(3, jnp.int32)), "scatter-add",
     "([i, j], [k, l], [k, n, j]) -> ([i, j]) reduction={k} blocked={l}"),
    ("embedding gradient", lambda t, i: jax.grad(lambda t: t[i].sum())(t), (jnp.ones((10, 6)), I23), "scatter-add",
     "([i, j], [k, l, m], [k, l, j]) -> ([i, j]) reduction={k, l} blocked={m}"),
    ("scatter set", lambda a, u: a.at[jnp.array([1, 3])].set(u), (X, jnp.ones((2, 6))), "scatter",
     "([i, j], [k, l], [k, j]) -> ([i, j]) blocked={k, l}"),
    # windows, sorting, randomness
    ("avg pool", lambda a: jax.lax.reduce_window(a, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
     (jnp.ones((2, 8, 8, 4)),), "reduce_window_sum", "([i, j, k, l]) -> ([i, m, n, l]) blocked={j, k, m, n}"),
    ("max pool gradient",
     lambda a: jax.grad(lambda a: jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID").sum())(a),
     (jnp.ones((2, 8, 8, 4)),), "select_and_scatter_add",
     "([i, j, k, l], [i, m, n, l]) -> ([i, o, p, l]) blocked={j, k, m, n, o, p}"),
    ("sort", lambda a: jnp.sort(a, 1), (X,), "sort", "([i, j]) -> ([i, j]) blocked={j}"),
    ("top_k", lambda a: jax.lax.top_k(a, 2), (X,), "top_k", "([i, j]) -> ([k, l], [k, l]) blocked={i, j, k, l}"),
    ("random_bits", lambda k: jax.random.normal(k, (4, 6)), (jax.random.key(0),), "random_bits", "([]) -> ([i, j])"),
    ("random_gamma", lambda k: jax.random.gamma(k, jnp.ones((4, 6))), (jax.random.key(0),), "random_gamma",
     "([], [i, j]) -> ([i, j])"),
    ("mulhi", lambda a: jax.lax.mulhi(a, a), (I23,), "mulhi", "([i, j], [i, j]) -> ([i, j])"),
    ("tile", lambda a: jnp.tile(a, (2, 1)), (X,), "tile", "([i, j]) -> ([k*i, j])"),
    ("generic reduce", lambda a: jax.lax.reduce(a, 0.0, lambda p, q: p * q + q, (1,)), (X,), "reduce",
     "([i, j], []) -> ([i]) blocked={j}"),
    # linear algebra and Fourier transforms: batched, whole per problem
    ("cholesky", jnp.linalg.cholesky, (B,), "cholesky", "([i, j, k]) -> ([i, l, m]) blocked={j, k, l, m}"),
    ("svd", jnp.linalg.svd, (B,), "svd", "([i, j, k]) -> ([i, l], [i, m, n], [i, o, p]) blocked={j, k, l, m, n, o, p}"),
    ("triangular_solve", lambda a, b: jax.lax.linalg.triangular_solve(a, b, left_side=True), (B, jnp.ones((3, 4, 2))),
     "triangular_solve", "([i, j, k], [i, l, m]) -> ([i, n, o]) blocked={j, k, l, m, n, o}"),
    ("fft", jnp.fft.fft, (X,), "fft", "([i, j]) -> ([i, k]) blocked={j, k}"),
    ("rfft2", jnp.fft.rfft2, (B,), "fft", "([i, j, k]) -> ([i, l, m]) blocked={j, k, l, m}"),
    # contractions with scales or groups
    ("scaled_dot", lambda a, b, s, t: jax.lax.scaled_dot(a, b, lhs_scale=s, rhs_scale=t),
     (jnp.ones((4, 8)), jnp.ones((8, 6)), jnp.ones((4, 2), jnp.float8_e8m0fnu), jnp.ones((2, 6), jnp.float8_e8m0fnu)),
     "scaled_dot", "([i, j*k], [j*k, l], [i, j], [j, l]) -> ([i, l]) reduction={j, k}"),
    ("ragged_dot", lambda a, b: jax.lax.ragged_dot(a, b, jnp.array([2, 2], jnp.int32)),
     (jnp.ones((4, 6)), jnp.ones((2, 6, 3))), "ragged_dot_general",
     "([i, j], [k, j, m], [n]) -> ([i, m]) reduction={j} blocked={i, k, n}"),
    # collectives over a vmapped axis
    ("psum under vmap", lambda a: jax.vmap(lambda r: jax.lax.psum(r, "i"), axis_name="i")(a), (X,), "psum",
     "([i, j]) -> ([j]) reduction={i}"),
    ("pmax under vmap", lambda a: jax.vmap(lambda r: jax.lax.pmax(r, "i"), axis_name="i")(a), (X,), "pmax",
     "([i, j]) -> ([j]) reduction max={i}"),
    # ops that run whole
    ("pure_callback", lambda a: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(a.shape, a.dtype), a), (X,),
     "pure_callback", "([i, j]) -> ([k, l]) blocked={i, j, k, l}"),
    ("rng_bit_generator", lambda k: jax.lax.rng_bit_generator(k, (4, 6)), (jnp.zeros(4, jnp.uint32),),
     "rng_bit_generator", "([i]) -> ([j], [k, l]) blocked={i, j, k, l}"),
    ("approx_max_k", lambda a: jax.lax.approx_max_k(a, 2), (X,), "approx_top_k",
     "([i, j]) -> ([k, l], [k, l]) blocked={i, j, k, l}"),
    ("dce_sink", jax.lax.dce_sink, (X,), "dce_sink", "([i, j]) -> ()"),
]


@pytest.mark.parametrize("name,fn,args,prim,expected", CASES, ids=[c[0] for c in CASES])
def test_rule_golden(name, fn, args, prim, expected):
    assert _rule(fn, *args, prim=prim) == expected
