"""FP8 matmuls (`examples/_fp8.py`): the Llama example's layers in FP8 compute what the
same step computes in bfloat16 within FP8's rounding, their plans compute what plain
jit computes, and the cost model runs their dots at the device's FP8 rate."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir
import search
import tactics
from examples import llama
from examples._fp8 import SCALINGS, CurrentScaling, Fp8Scales, fp8_einsum
from partir import MeshSpec

EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates
FP8 = llama.LlamaConfig(dtype=jnp.bfloat16, scan_layers=True, adam_eps=EPS, fp8=True)


def test_fp8_einsum_and_its_gradients_track_einsum_within_fp8_rounding():
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (4, 8, 32), jnp.bfloat16)
    w = jax.random.normal(kw, (32, 16), jnp.bfloat16) / 4
    cot = jax.random.normal(kg, (4, 8, 16), jnp.float32)
    scales = Fp8Scales(gradient=1.0)  # the cotangent is O(1) here, not a mean loss's

    def loss(dot, x, w):
        return jnp.sum(dot("bsd,df->bsf", x, w).astype(jnp.float32) * cot)

    fp8 = jax.value_and_grad(lambda x, w: loss(lambda s, a, b: fp8_einsum(s, a, b, scales), x, w), (0, 1))(x, w)
    ref = jax.value_and_grad(lambda x, w: loss(jnp.einsum, x, w), (0, 1))(x, w)
    for got, want in zip(jax.tree.leaves(fp8), jax.tree.leaves(ref), strict=True):
        assert got.dtype == want.dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        # E4M3 keeps 3 mantissa bits and E5M2 2: each product is off by up to ~1/8 of
        # itself, and sums of many cancel most of it; a wrong transpose is off by O(1).
        assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()


@pytest.mark.parametrize("magnitude", [1.0, 1e-7])
def test_current_scaling_tracks_einsum_whatever_the_gradients_magnitude(magnitude):
    # Each tensor scaled by its own maximum: a mean loss's tiny gradients (1e-7, below
    # E5M2's smallest normal with no scale) keep FP8's relative precision, as the
    # output and both gradients show element by element.
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (4, 8, 32), jnp.bfloat16)
    w = jax.random.normal(kw, (32, 16), jnp.bfloat16) / 4
    cot = (jax.random.normal(kg, (4, 8, 16), jnp.float32) * magnitude).astype(jnp.bfloat16)

    def run(dot):
        y, vjp = jax.vjp(lambda x, w: dot("bsd,df->bsf", x, w), x, w)
        return (y, *vjp(cot))

    got = run(lambda s, a, b: fp8_einsum(s, a, b, CurrentScaling()))
    for g, want in zip(got, run(jnp.einsum), strict=True):
        g, want = np.asarray(g, np.float32), np.asarray(want, np.float32)
        assert np.abs(g - want).max() <= 0.1 * np.abs(want).max()


def test_fp8_einsum_refuses_operands_of_two_dtypes():
    x, w = jnp.ones((2, 4), jnp.bfloat16), jnp.ones((4, 3), jnp.float32)
    with pytest.raises(TypeError, match="x is bfloat16 and w is float32; cast both"):
        fp8_einsum("bd,df->bf", x, w)
    with pytest.raises(TypeError, match="x is bfloat16 and w is float32; cast both"):
        jax.grad(lambda w: fp8_einsum("bd,df->bf", x, w).astype(jnp.float32).sum())(w)


def test_the_layers_dots_run_in_fp8_and_the_head_in_bfloat16():
    step, args = llama.make_train_step(FP8, abstract=True)
    prog = partir.lift(step, *args)
    dots = [[prog.values[v] for v in op.operands[:2]] for op in prog.ops
            if op.primitive == "dot_general" and not op.link]
    fp8 = sorted(tuple(str(v.dtype) for v in d) for d in dots if any("float8" in str(v.dtype) for v in d))
    # 7 projections a layer (the scan's body): 7 forward dots in E4M3, 14 gradient dots
    # with the E5M2 gradient; the attention's own dots and the head's (its forward
    # dot and its input gradient's) stay bfloat16.
    assert fp8 == sorted([("float8_e4m3fn", "float8_e4m3fn")] * 7 + [("float8_e4m3fn", "float8_e5m2")] * 7
                         + [("float8_e5m2", "float8_e4m3fn")] * 7)
    head = [d for d in dots if d[1].shape == (FP8.d_model, FP8.vocab)]
    assert len(head) == 2 and {str(v.dtype) for d in head for v in d} == {"bfloat16"}


#: The FP8 MaxText rows' layout (FSDP) and tensor parallelism, where the FP8 dots' sums
#: run over a split dim; FSDP (6 s) in `make test-slow`.
PLANS = {"fsdp": ([tactics.FSDP("data")], MeshSpec.of(data=8)),
         "dp-megatron": ([tactics.DataParallel("data"), tactics.Megatron("model")], MeshSpec.of(data=4, model=2))}


# Delayed scaling only. A shard's kernel can round a float32 an ulp apart from jit's;
# under delayed scaling's constant scales the step shrugs that off (measured: 12 draws
# of every parameter moved by an ulp, no output of plain jit's step past this
# tolerance). Under current scaling each scale follows its tensor's maximum, and one
# flipped E5M2 gradient moves the next layer's maxima and flips more: the same 12 draws
# put 664 to 66195 outputs past it, and the FSDP plan's step is off jit's the same way
# (47 of the embedding's 16384 weights at XLA's optimization level 0, 318 at its
# default). `test_fp8_dots_partition_exactly` checks current scaling where no ulp arises.
@pytest.mark.parametrize("name", ["dp-megatron", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_an_fp8_plan_computes_what_jit_computes(name):
    # Float32 activations around the FP8 dots: the plan's sums in another order stay
    # within float32's rounding (in bfloat16 one rounding difference upstream flips an
    # E5M2 step, an eighth of a value, and a wrong result would hide in that noise).
    step, args = llama.make_train_step(dataclasses.replace(FP8, dtype=jnp.float32))
    schedule, mesh = PLANS[name]
    res = tactics.apply_schedule(partir.lift(step, *args), mesh, schedule)
    partir.check_equivalence(step, args, res.partitioning, rtol=2e-5, atol=2e-6)


def _small_integers(key, shape, unit=1.0):
    """Integers in [-7, 7] times `unit`, 7 among them: a maximum of 7 makes current
    scaling's scales powers of two (7/448 = 2**-6 for E4M3, 7*2**-13/57344 = 2**-26 for
    E5M2 at `unit` 2**-13), and every such integer is exact in both formats."""
    values = jax.random.randint(key, shape, -7, 8).astype(jnp.float32)
    return values.at[(0,) * len(shape)].set(7.0) * unit


def _two_fp8_dots(scales):
    def fn(params, batch):
        def f(x, w1, w2):
            return fp8_einsum("bh,hf->bf", fp8_einsum("bd,dh->bh", x, w1, scales), w2, scales)

        z, vjp = jax.vjp(f, batch["x"], params["w1"], params["w2"])
        return (z, *vjp(batch["g"]))

    return fn


#: Layouts of `_two_fp8_dots`: FSDP's, Megatron's (the hidden dim split, the second dot's
#: sum over it), and the first dot's sum split (its partial sums summed before the cast).
_DOT_LAYOUTS = {
    "fsdp": (MeshSpec.of(data=8), [tactics.Shard("params/*", 0, "data")]),
    "megatron": (MeshSpec.of(data=4, model=2),
                 [tactics.Shard("params/w1", 1, "model"), tactics.Shard("params/w2", 0, "model")]),
    "split-sum": (MeshSpec.of(data=4, model=2), [tactics.Shard("params/w1", 0, "model")]),
}


@pytest.mark.parametrize("backend", ["jit", "shard_map"])
@pytest.mark.parametrize("layout", list(_DOT_LAYOUTS))
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fp8_dots_partition_exactly(scaling, layout, backend):
    # Two chained FP8 dots and their gradients on small integers (`_small_integers`):
    # every product is exact, every sum an exact float32 in any order, so each FP8 cast
    # sees the same bits in the plan as in jit, the maxima included, and the plan must
    # match jit bit for bit. A maximum combined across shards as anything but a max, or
    # a cast of partial sums, is off on every element (measured: reduce_max's partial
    # results summed, 128 of 128 outputs differ under current scaling).
    kx, k1, k2, kg = jax.random.split(jax.random.key(0), 4)
    params = {"w1": _small_integers(k1, (32, 16)), "w2": _small_integers(k2, (16, 8))}
    batch = {"x": _small_integers(kx, (16, 32)), "g": _small_integers(kg, (16, 8), 2.0**-13)}
    fn = _two_fp8_dots(SCALINGS[scaling])
    mesh, shards = _DOT_LAYOUTS[layout]
    part = tactics.apply_schedule(partir.lift(fn, params, batch), mesh,
                                  [tactics.Shard("batch/*", 0, "data"), *shards]).partitioning
    partir.check_equivalence(fn, (params, batch), part, rtol=0, atol=0, backend=backend)


def _compute_seconds(fp8: bool, scaling: str = "delayed") -> float:
    config = dataclasses.replace(llama.LLAMA3_8B, fp8=fp8, fp8_scaling=scaling, batch=8)
    step, args = llama.make_train_step(config, abstract=True)
    part = tactics.apply_schedule(partir.lift(step, *args), MeshSpec.of(data=8),
                                  [tactics.DataParallel("data")]).partitioning
    return search.CostModel(part, "h100").cost().compute_time


def test_fp8_dots_run_at_the_devices_fp8_rate():
    # H100's FP8 tensor cores run twice its bfloat16 rate: the projections, most of an
    # 8B layer's flops, take half as long; attention, norms and the head do not change.
    bf16, fp8 = _compute_seconds(False), _compute_seconds(True)
    assert 0.5 < fp8 / bf16 < 0.75


def test_current_scaling_reads_each_quantized_tensor_once_more():
    # Each tensor's maximum is a reduction the cast waits on: a pass over every FP8
    # operand and gradient before its cast, which delayed scaling's constant scales skip.
    # On an 8B layer a few percent of the step, the projections' FP8 matmuls the rest.
    delayed, current = _compute_seconds(True), _compute_seconds(True, "current")
    assert 1.02 < current / delayed < 1.1


def test_fp8_scaling_without_fp8_is_refused():
    with pytest.raises(ValueError, match=r"fp8_scaling='current' needs fp8=True"):
        llama.LlamaConfig(fp8_scaling="current")
    with pytest.raises(ValueError, match=r"unknown fp8_scaling 'late'; allowed: \['delayed', 'current'\]"):
        llama.LlamaConfig(fp8=True, fp8_scaling="late")


def test_an_fsdp_plan_gathers_the_fp8_weights_xla_gathers():
    # FSDP quantizes each weight where it rests and gathers its FP8 bytes, as XLA's
    # collective quantizer moves a quantization ahead of an all-gather. XLA:CPU moves an
    # FP8 buffer in float16 (as it moves bfloat16 in float32; the program holds no other
    # float16): counted at FP8's byte an element, its gathers are the model's, byte for
    # byte. Float32 around the dots, for the same reason.
    step, args = llama.make_train_step(dataclasses.replace(FP8, dtype=jnp.float32), abstract=True)
    part = tactics.apply_schedule(partir.lift(step, *args), MeshSpec.of(data=8), [tactics.FSDP("data")]).partitioning
    mesh = part.mesh.jax_mesh()
    compiled = partir.lower(part, mesh).lower(*args).compile()
    gathers = [c for c in partir.collectives(compiled.as_text(), mesh) if c.kind == partir.Kind.ALL_GATHER]
    widened = sum(math.prod(dims) for c in gathers for dtype, dims in c.shapes if dtype == "f16")
    assert widened > 0
    modeled = [c for c in search.CostModel(part, "cpu").cost().collectives if c.kind == partir.Kind.ALL_GATHER]
    assert len(modeled) == len(gathers)
    assert sum(c.bytes for c in modeled) == sum(c.result_bytes for c in gathers) - widened
