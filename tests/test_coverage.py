"""Every example lifts without any primitive falling back to the no-rule path."""

import jax.numpy as jnp
import pytest

import partir
from examples import REGISTRY, gpt, llama

VARIANTS = {name: (lambda make=make: make(abstract=True)) for name, make in REGISTRY.items()}
VARIANTS.update({
    f"gpt-{flag}": (lambda flag=flag: gpt.make_train_step(gpt.GPTConfig(**{flag: True}), abstract=True))
    for flag in ("scan_layers", "remat", "fused_qkv")
})
LLAMA = {"scan-remat-dots": {"scan_layers": True, "remat": True, "remat_policy": "dots"}, "bf16": {"dtype": jnp.bfloat16}}
VARIANTS.update({
    f"llama-{name}": (lambda kw=kw: llama.make_train_step(llama.LlamaConfig(**kw), abstract=True))
    for name, kw in LLAMA.items()
})


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_primitive_has_a_rule(name):
    step, args = VARIANTS[name]()
    prog = partir.lift(step, *args)
    assert prog.fallbacks == ()
    missing = sorted(p for p in prog.primitives() if partir.rules.get_rule(p) is None)
    assert missing == []
