"""Every primitive that the public functions of `jax.numpy`, `jax.lax`, `jax.nn` and
`jax.random` (and their gradients) emit on this JAX version has a partitioning rule, or
is a call that lift enters: lifting the generated corpus (`primitive_corpus`) never
falls back to replicating an op for want of a rule. And the new families' splits
compute what plain `jax.jit` computes."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir
import primitive_corpus
from partir import MeshSpec


@pytest.fixture(scope="module")
def lifted():
    """`(name, program)` for each call of the corpus."""
    out = []
    for name, fn, args in primitive_corpus.corpus():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecations of the corpus itself; fallbacks are read off
            out.append((name, partir.lift(fn, *args)))
    return out


@pytest.mark.slow  # (the corpus takes 13 s to lift: CI runs it, `make test-slow`)
def test_the_corpus_is_broad(lifted):
    names = {n for n, _ in lifted}
    assert len(names) > 700  # hundreds of public functions, and their gradients
    assert {"jax.numpy.stack", "jax.numpy.linalg.svd", "jax.numpy.fft.fft", "jax.nn.softmax",
            "jax.random.normal", "grad of jax.numpy.sin"} <= names
    seen = set().union(*(primitive_corpus.primitives(prog.closed_jaxpr) for _, prog in lifted))
    assert len(seen) > 150
    assert {"stack", "unstack", "dot_general", "cumsum", "sort", "random_bits", "scan", "custom_jvp_call"} <= seen


@pytest.mark.slow
def test_every_primitive_has_a_rule(lifted):
    missing = {}
    for name, prog in lifted:
        for prim in prog.fallbacks:
            missing.setdefault(prim, []).append(name)
    listing = "; ".join(f"{p} (from {', '.join(sorted(ns)[:3])})" for p, ns in sorted(missing.items()))
    assert not missing, f"primitives without a partitioning rule: {listing}"


def _new_families(a, idx, table):
    """One output per new rule family that lets a dim split: stack, unstack, tile,
    batched linear algebra and FFT, a lookup under vmap, a psum under vmap."""
    spd = a @ jnp.swapaxes(a, 1, 2) + 8 * jnp.eye(a.shape[-1])
    return (jnp.stack([a, 2 * a], 1), jnp.unstack(a, axis=1)[1], jnp.tile(a, (1, 2, 1)),
            jnp.linalg.cholesky(spd), jnp.fft.fft(a).real, jax.vmap(lambda i: table[i])(idx),
            jax.vmap(lambda r: jax.lax.psum(r, "i"), axis_name="i")(a))


def test_new_families_split_and_stay_equivalent():
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.standard_normal((4, 8, 8)), jnp.float32), jnp.asarray([3, 0, 7, 5], jnp.int32),
            jnp.asarray(rng.standard_normal((16, 8)), jnp.float32))
    prog = partir.lift(_new_families, *args)
    part = partir.Partitioning(prog, MeshSpec.of(x=2, y=4))
    part.tile("a", 0, "x")
    part.tile("table", 0, "y")  # the vocabulary of the lookup under vmap
    outs = [part.tiling(v) for v in prog.outputs]
    assert [t.dims[0] for t in outs[:5]] == [("x",)] * 5  # batch dims pass through
    lookup = next(op for op in prog.ops if op.primitive == "gather")
    assert part.produced(lookup.results[0]).partial == ("y",)  # each device looks up the rows it holds
    partir.check_equivalence(_new_families, args, part)
