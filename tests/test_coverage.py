"""Every example lifts without any primitive falling back to the no-rule path."""

import pytest

import partir
from examples import REGISTRY, gpt

VARIANTS = {name: (lambda make=make: make(abstract=True)) for name, make in REGISTRY.items()}
VARIANTS.update({
    f"gpt-{flag}": (lambda flag=flag: gpt.make_train_step(gpt.GPTConfig(**{flag: True}), abstract=True))
    for flag in ("scan_layers", "remat", "fused_qkv")
})


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_primitive_has_a_rule(name):
    step, args = VARIANTS[name]()
    prog = partir.lift(step, *args)
    assert prog.fallbacks == ()
    missing = sorted(p for p in prog.primitives() if partir.rules.get_rule(p) is None)
    assert missing == []
