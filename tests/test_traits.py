"""The one table of op traits (`partir.rules.get_traits`): every primitive with a rule
has its traits, every trait is filled in, and the cost model's work count reads them
(what XLA's `cost_analysis` counts)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import partir
from partir import rules
from partir.rules import Fusion, Traits, Work
from search.cost._flops import eqn_work


def test_every_registered_primitive_has_every_trait():
    for name in rules.registered():
        traits = rules.get_traits(name)
        assert isinstance(traits, Traits), name
        assert isinstance(traits.work, Work) and isinstance(traits.fusion, Fusion), name
        for f in dataclasses.fields(Traits):
            assert getattr(traits, f.name) is not None, (name, f.name)


def test_registering_a_rule_without_traits_is_refused():
    with pytest.raises(TypeError):
        rules.register("not_a_primitive")(lambda *a: None)
    with pytest.raises(ValueError, match="without its traits"):
        rules.register("not_a_primitive", "nor_this", traits={"not_a_primitive": Traits(Work.MOVE)})


def test_no_primitive_without_traits_costs_work():
    assert rules.get_traits("not_a_primitive") is None
    assert eqn_work("not_a_primitive", {}, ((4,),), ((4,),)) == (0.0, 0.0)


@pytest.mark.parametrize("fn", [jnp.tanh, jax.scipy.special.erf, lambda x: jax.lax.nextafter(x, x + 1),
                                jax.lax.erf_inv, jax.lax.lgamma, jnp.sinh, jnp.arcsinh])
def test_elementwise_work_is_what_xla_counts(fn):
    x = jnp.linspace(0.1, 0.9, 256, dtype=jnp.float32)
    want = jax.jit(fn).lower(x).compile().cost_analysis()
    want = want[0] if isinstance(want, list) else want
    prog = partir.lift(fn, x)
    flops = trans = 0.0
    for op in prog.ops:
        if not op.link:
            f, t = eqn_work(op.primitive, op.eqn.params, [prog.values[v].shape if v >= 0 else () for v in op.operands],
                            [prog.values[v].shape for v in op.results if v >= 0])
            flops, trans = flops + f, trans + t
    assert (flops, trans) == (want.get("flops", 0.0), want.get("transcendentals", 0.0))
