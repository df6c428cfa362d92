"""Lowering: sharded jit of nested jaxprs stays equivalent, and honours the plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import partir
from partir import MeshSpec, PartitioningError

MESH = MeshSpec.of(data=2, model=4)
KEY = jax.random.PRNGKey(0)


def _w(shape, k=0):
    return jax.random.normal(jax.random.fold_in(KEY, k), shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)


@jax.custom_jvp
def _softplus(x):
    return jnp.logaddexp(x, 0.0)


_softplus.defjvp(lambda p, t: (_softplus(p[0]), jax.nn.sigmoid(p[0]) * t[0]))


@jax.custom_vjp
def _clip_grad(x):
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


def _layer(w, h):
    return jnp.tanh(h @ w)


NESTED = {
    "scan": lambda ws, x: jax.lax.scan(lambda c, w: (_layer(w, c), c.sum()), x, ws),
    "while": lambda ws, x: jax.lax.while_loop(lambda c: jnp.abs(c).sum() > 1.0, lambda c: c * 0.5, x @ ws[0]),
    "fori": lambda ws, x: jax.lax.fori_loop(0, 3, lambda i, c: _layer(ws[i], c), x),
    "cond": lambda ws, x: jax.lax.cond(x.sum() > 0, lambda a: _layer(ws[0], a), lambda a: _layer(ws[1], a) * 2, x),
    "remat": lambda ws, x: jax.checkpoint(lambda a: _layer(ws[1], _layer(ws[0], a)))(x),
    "custom_jvp": lambda ws, x: _softplus(x @ ws[0]),
    "custom_vjp": lambda ws, x: _clip_grad(x @ ws[0]) @ ws[1],
    "jit": lambda ws, x: jax.jit(_layer)(ws[0], x),
}


def _loss(kind):
    def loss(ws, x):
        out = NESTED[kind](ws, x)
        return sum(jnp.sum(o ** 2) for o in jax.tree_util.tree_leaves(out))
    return loss


CASES = [(k, g) for k in sorted(NESTED) for g in (False, True) if not (k == "while" and g)]  # while: no reverse mode


# The forward alone of a kind that has a gradient case in `make test-slow`: its `-grad`
# case lowers the same nested forward, and its transpose (as tests/test_shardmap.py's do).
@pytest.mark.parametrize("kind,grad", [pytest.param(k, g, marks=pytest.mark.slow if not g and k != "while" else ())
                                       for k, g in CASES], ids=[f"{k}-{'grad' if g else 'fwd'}" for k, g in CASES])
def test_nested_jaxprs_lower_equivalently(kind, grad):
    ws, x = _w((3, 16, 16), 1), _w((8, 16), 2)
    fn = jax.value_and_grad(_loss(kind)) if grad else NESTED[kind]
    prog = partir.lift(fn, ws, x)
    part = partir.Partitioning(prog, MESH)
    part.tile("x", 0, "data")
    part.tile("ws", 2, "model")
    partir.check_equivalence(fn, (ws, x), part, rtol=2e-5, atol=2e-6)


def test_lowered_shardings_follow_the_plan():
    def f(w1, w2, x):
        return jnp.tanh(x @ w1) @ w2

    args = (_w((16, 32)), _w((32, 8), 1), _w((8, 16), 2))
    part = partir.Partitioning(partir.lift(f, *args), MESH)
    part.tile("x", 0, "data")
    part.tile("w1", 1, "model")
    fn = partir.lower(part)
    out = fn(*args)
    assert out.sharding.spec == PartitionSpec("data", None)
    compiled = fn.lower(*args).compile()
    assert [s.spec for s in compiled.input_shardings[0]] == [PartitionSpec(None, "model"), PartitionSpec("model", None),
                                                             PartitionSpec("data", None)]
    cols = partir.collectives_of(fn, *args, mesh=part.mesh.jax_mesh())
    assert [(c.kind, c.axes) for c in cols] == [("all-reduce", ("model",))]
    assert cols[0].result_bytes == 4 * 8 * 4  # [8/2 rows, 8] f32 per device


def test_boundary_mode_and_errors():
    f = lambda w, x: x @ w  # noqa: E731
    args = (_w((16, 8)), _w((8, 16), 1))
    part = partir.Partitioning(partir.lift(f, *args), MESH)
    part.tile("x", 0, "data")
    partir.check_equivalence(f, args, part, constrain="boundary")
    with pytest.raises(PartitioningError, match="constrain='most'"):
        partir.lower(part, constrain="most")
    with pytest.raises(PartitioningError, match="unknown lowering backend 'pmap'"):
        partir.lower(part, backend="pmap")
    wrong = MeshSpec.of(data=4, model=2).jax_mesh()
    with pytest.raises(PartitioningError, match="same axis names and sizes"):
        partir.lower(part, wrong)
    with pytest.raises(PartitioningError, match="structure the plan was made for"):
        partir.lower(part)(args[0], args[1], args[1])
