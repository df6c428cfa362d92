"""A generated corpus of the public functions of `jax.numpy` (with `linalg` and `fft`),
`jax.lax` (with `linalg`), `jax.nn` and `jax.random`, and the primitives their jaxprs
(and their gradients') hold.

Each function is called generically: with 1 to 3 small float arrays, then int, then
bool ones (square matrices, so the linear algebra traces), or for `jax.random` with a
key and a shape; functions that take no such arguments are skipped, and a few that
need structured arguments (windows, convolutions, loops, callbacks) get a call of their
own. Nothing is compiled: everything is traced with `jax.make_jaxpr`.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxprs_in_params

MODULES = {
    "jax.numpy": jnp, "jax.numpy.linalg": jnp.linalg, "jax.numpy.fft": jnp.fft, "jax.lax": jax.lax,
    "jax.lax.linalg": jax.lax.linalg, "jax.nn": jax.nn, "jax.random": jax.random,
}


def _arrays(dtype, rank=2):
    base = np.arange(16, dtype=np.float32).reshape(4, 4) / 16 + np.eye(4, dtype=np.float32)
    out = {"float": base, "int": np.arange(16, dtype=np.int32).reshape(4, 4) % 4,
           "bool": np.arange(16).reshape(4, 4) % 3 == 0}[dtype]
    return jnp.asarray(out if rank == 2 else out[0])


def _calls(module_name: str, fn):
    """Argument tuples to try on `fn`, most likely first."""
    f, f1 = _arrays("float"), _arrays("float", 1)
    if module_name == "jax.random":
        key = jax.random.key(0)
        yield from [(key,), (key, (4, 4)), (key, f), (key, f, f), (key, 4, (4,)), (key, (4,), 0, 4), (key, f1, (2,))]
        return
    for dtype in ("float", "int", "bool"):
        for n in (1, 2, 3):
            yield (_arrays(dtype),) * n
    yield from [(f, 1), (f, 2), (f, 0, 1), (f, (0,)), (f, (16,)), (f, (2, 4, 4)), (f, _arrays("int"))]
    yield from [(f1,), (f1, f1), (f1, f1, f1), (_arrays("int", 1),), (4,), ((4, 4),), ((4, 4), 1.0)]


def primitives(jaxpr, out=None) -> set[str]:
    """Primitive names in a jaxpr and, recursively, the jaxprs in its equations' params."""
    out = set() if out is None else out
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            primitives(sub, out)
    return out


@contextlib.contextmanager
def _unfiltered_tracebacks():
    """Most generic calls fail to trace; JAX's filtering of each failure's traceback (a
    path comparison per frame) took half of the corpus's making, for tracebacks no one
    reads. Off while the corpus is made, as it was after."""
    previous = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        yield
    finally:
        jax.config.update("jax_traceback_filtering", previous)


def _traces(fn, args) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.make_jaxpr(fn)(*args)
        return True
    except Exception:  # a call this generic scheme cannot make
        return False


def _gradient(fn, args):
    """The gradient of the sum of `fn`'s (real parts of its) outputs with respect to its
    float arguments, as a function of those, and them; None when there is none."""
    floats = [i for i, a in enumerate(args) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
    if not floats:
        return None

    def loss(*xs):
        full = list(args)
        for i, x in zip(floats, xs):
            full[i] = x
        outs = jax.tree.leaves(fn(*full))
        return sum(jnp.real(o).sum() for o in outs if jnp.issubdtype(o.dtype, jnp.inexact))

    grad = jax.grad(loss, argnums=tuple(range(len(floats))))
    picked = tuple(args[i] for i in floats)
    return (grad, picked) if _traces(grad, picked) else None


def _public(module):
    for name in sorted(dir(module)):
        fn = getattr(module, name)
        if name.startswith("_") or inspect.isclass(fn) or inspect.ismodule(fn) or not callable(fn):
            continue
        yield name, fn


def _structured():
    """Calls the generic scheme cannot make: (name, fn, args)."""
    x, k = _arrays("float"), jnp.ones((2, 2), jnp.float32)
    img, ker = jnp.ones((1, 4, 4, 2)), jnp.ones((2, 2, 2, 3))
    yield "lax.conv_general_dilated", lambda a, w: jax.lax.conv_general_dilated(
        a, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), (img, ker)
    yield "lax.reduce_window max", lambda a: jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, (2, 2), (1, 1), "VALID"), (x,)
    yield "lax.reduce_window add", lambda a: jax.lax.reduce_window(a, 0.0, jax.lax.add, (2, 2), (2, 2), "VALID"), (x,)
    yield "lax.reduce_window min", lambda a: jax.lax.reduce_window(a, jnp.inf, jax.lax.min, (2, 2), (1, 1), "SAME"), (x,)
    yield "lax.reduce", lambda a: jax.lax.reduce(a, 0.0, lambda p, q: p * q + q, (0,)), (x,)
    yield "lax.scan", lambda a: jax.lax.scan(lambda c, r: (c + r, c * r), a[0], a)[1], (x,)
    yield "lax.fori_loop", lambda a: jax.lax.fori_loop(0, 3, lambda i, c: c * 2.0, a), (x,)
    yield "lax.while_loop", lambda a: jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c * 2.0, a), (x,)
    yield "lax.cond", lambda a: jax.lax.cond(a.sum() > 0, jnp.sin, jnp.cos, a), (x,)
    yield "lax.switch", lambda a: jax.lax.switch(1, [jnp.sin, jnp.cos], a), (x,)
    yield "lax.map", lambda a: jax.lax.map(jnp.sin, a), (x,)
    yield "lax.associative_scan", lambda a: jax.lax.associative_scan(jnp.add, a), (x,)
    yield "lax.top_k", lambda a: jax.lax.top_k(a, 2), (x,)
    yield "lax.dynamic_update_slice", lambda a, b: jax.lax.dynamic_update_slice(a, b, (1, 1)), (x, k)
    yield "lax.dynamic_slice", lambda a: jax.lax.dynamic_slice(a, (1, 1), (2, 2)), (x,)
    yield "lax.pad", lambda a: jax.lax.pad(a, 0.0, ((1, 1, 1), (0, 0, 0))), (x,)
    yield "lax.sort multi", lambda a, b: jax.lax.sort((a, b), num_keys=1), (x, x)
    yield "lax.reduce_precision", lambda a: jax.lax.reduce_precision(a, 5, 10), (x,)
    yield "lax.rng_bit_generator", lambda: jax.lax.rng_bit_generator(jnp.zeros(4, jnp.uint32), (4, 4)), ()
    yield "lax.rng_uniform", lambda: jax.lax.rng_uniform(0.0, 1.0, (4,)), ()
    yield "lax.axis_index", lambda a: jax.vmap(lambda r: r * jax.lax.axis_index("i"), axis_name="i")(a), (x,)
    yield "lax.psum under vmap", lambda a: jax.vmap(lambda r: jax.lax.psum(r, "i"), axis_name="i")(a), (x,)
    yield "jnp.take_along_axis", lambda a, i: jnp.take_along_axis(a, i, 1), (x, _arrays("int"))
    yield "jnp.einsum", lambda a, b: jnp.einsum("ij,jk->ik", a, b), (x, x)
    yield "jnp.fft.fftn", lambda a: jnp.fft.fftn(a), (x,)
    yield "pure_callback", lambda a: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(a.shape, a.dtype), a), (x,)
    yield "debug.print", lambda a: (jax.debug.print("{}", a), a)[1], (x,)
    yield "checkpoint", lambda a: jax.checkpoint(jnp.sin)(a), (x,)
    yield "custom_jvp", lambda a: jax.nn.relu(a), (x,)
    yield "custom_vjp", lambda a: jax.numpy.linalg.norm(a), (x,)
    yield "random key_data", lambda: jax.random.key_data(jax.random.key(0)), ()
    yield "random wrap_key_data", lambda: jax.random.wrap_key_data(jnp.zeros(2, jnp.uint32)), ()
    yield "random raw key", lambda: jax.random.normal(jax.random.PRNGKey(0), (4,)), ()
    yield "random fold_in", lambda: jax.random.fold_in(jax.random.key(0), 3), ()
    yield "random split", lambda: jax.random.split(jax.random.key(0), 4), ()
    yield "random clone", lambda: jax.random.clone(jax.random.key(0)), ()
    yield from _structured_more(x)


def _structured_more(x):
    """More calls with structured arguments: attention, odd linear algebra, ragged and
    approximate ops, composites, and the collectives over a `vmap` axis."""
    yield "nn.dot_product_attention", lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True), (
        jnp.ones((2, 4, 2, 8)),)
    yield "lax.linalg.householder_product", lambda a, t: jax.lax.linalg.householder_product(a, t), (x, x[0])
    yield "lax.linalg.tridiagonal_solve", lambda a, b: jax.lax.linalg.tridiagonal_solve(
        a[0] * 0, a[1], a[2] * 0, b), (x, x)
    yield "lax.linalg.lu_pivots_to_permutation", lambda p: jax.lax.linalg.lu_pivots_to_permutation(p, 4), (
        _arrays("int", 1),)
    yield "lax.linalg.cholesky_update", lambda a, v: jax.lax.linalg.cholesky_update(a, v), (x, x[0])
    yield "lax.ragged_dot", lambda a, b: jax.lax.ragged_dot(a, b, jnp.array([2, 2], jnp.int32)), (
        x, jnp.ones((2, 4, 3)))
    yield "lax.approx_max_k", lambda a: jax.lax.approx_max_k(a, 2), (x,)
    yield "lax.composite", lambda a: jax.lax.composite(lambda y: jnp.sin(y), "my.sin")(a), (x,)
    yield "lax.platform_dependent", lambda a: jax.lax.platform_dependent(a, cpu=jnp.sin, default=jnp.cos), (x,)
    for collective in ("psum", "pmax", "pmin", "pmean", "all_gather", "axis_index", "axis_size"):
        yield f"lax.{collective} under vmap", _over_axis(collective), (x,)
    yield "lax.ppermute under vmap", lambda a: jax.vmap(
        lambda r: jax.lax.ppermute(r, "i", [(j, (j + 1) % 4) for j in range(4)]), axis_name="i")(a), (x,)
    yield "lax.psum_scatter under vmap", lambda a: jax.vmap(
        lambda r: jax.lax.psum_scatter(r, "i", tiled=True), axis_name="i")(a), (x,)
    yield "lax.all_to_all under vmap", lambda a: jax.vmap(
        lambda r: jax.lax.all_to_all(r, "i", 0, 0, tiled=True), axis_name="i")(a), (x,)


def _over_axis(name):
    """`jax.lax.<name>` over a `vmap` axis (collectives need a named axis)."""
    fn = getattr(jax.lax, name)
    if name in ("axis_index", "axis_size"):
        return lambda a: jax.vmap(lambda r: r * fn("i"), axis_name="i")(a)
    return lambda a: jax.vmap(lambda r: fn(r, "i"), axis_name="i")(a)


def corpus():
    """`(name, fn, args)` for each call that traces: the public functions called
    generically (the first call that traces), the structured calls, and the gradient of
    each where it has one."""
    with _unfiltered_tracebacks():
        return _corpus()


def _corpus():
    calls = []
    for module_name, module in MODULES.items():
        for name, fn in _public(module):
            args = next((a for a in _calls(module_name, fn) if _traces(fn, a)), None)
            if args is not None:
                calls.append((f"{module_name}.{name}", fn, args))
    calls += [(name, fn, args) for name, fn, args in _structured() if _traces(fn, args)]
    grads = []
    for name, fn, args in calls:
        g = _gradient(fn, args)
        if g is not None:
            grads.append((f"grad of {name}", *g))
    return calls + grads
