"""Tilings, meshes and lifting: the IR's types and what `lift` builds."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import Primitive
from jax.sharding import AxisType, PartitionSpec

import partir
from partir import Link, MeshSpec, PartitioningError, Tiling


# -- tilings -------------------------------------------------------------------------
def test_tiling_prints_as_partition_spec():
    t = Tiling((("data",), (), ("data2", "model")))
    assert str(t) == "P('data', None, ('data2', 'model'))"
    assert t.spec() == PartitionSpec("data", None, ("data2", "model"))
    assert str(Tiling(((),), ("model",))) == "P(None) partial{model}"
    assert str(Tiling(((),), ("model",), "max")) == "P(None) partial-max{model}"


def test_tiling_roundtrips_specs_and_hashes():
    t = Tiling.from_spec(PartitionSpec(None, ("a", "b")), 3)
    assert t.dims == ((), ("a", "b"), ())
    assert hash(t) == hash(Tiling(((), ("a", "b"), ())))
    assert Tiling.replicated(2).is_replicated and not t.is_replicated
    assert t.shard_shape((4, 8, 2), MeshSpec.of(a=2, b=2)) == (4, 2, 2)
    # A kind without partial axes is meaningless and normalised away.
    assert Tiling(((),), (), "max") == Tiling(((),))


# -- meshes --------------------------------------------------------------------------
def test_mesh_spec_parse_and_real_mesh():
    m = MeshSpec.parse("data=2,model=4")
    assert m == MeshSpec.of(data=2, model=4)
    assert m.num_devices == 8 and m.size("model") == 4 and str(m) == "data=2,model=4"
    assert m.devices_along(("data", "model")) == 8 and m.devices_along(["model"]) == 4 and m.devices_along(()) == 1
    jm = m.jax_mesh()
    assert dict(jm.shape) == {"data": 2, "model": 4}
    assert all(t == AxisType.Auto for t in jm.axis_types)
    big = MeshSpec.of(data=64, model=8)  # plannable without devices
    assert big.num_devices == 512
    with pytest.raises(PartitioningError, match="needs 512 devices"):
        big.jax_mesh()


@pytest.mark.parametrize("text,match", [("data=2,model", "NAME=SIZE"), ("data=x", "NAME=SIZE"),
                                        ("data=2,data=4", "unique"), ("data=0", "positive")])
def test_mesh_spec_rejects_bad_text(text, match):
    with pytest.raises(PartitioningError, match=match):
        MeshSpec.parse(text)


def test_unknown_axis_lists_the_mesh_axes():
    with pytest.raises(PartitioningError, match=r"'modle' is not in the mesh; its axes are \['data', 'model'\]"):
        MeshSpec.of(data=2, model=4).size("modle")
    with pytest.raises(PartitioningError, match=r"'modle' is not in the mesh"):
        MeshSpec.of(data=2, model=4).devices_along(("data", "modle"))


# -- lift ----------------------------------------------------------------------------
def _mlp_step(params, batch):
    h = jnp.tanh(batch["x"] @ params["layers"][0]["w"])
    return jnp.mean((h @ params["layers"][1]["w"] - batch["y"]) ** 2)


def _mlp_args(abstract=False):
    shapes = ({"layers": [{"w": (16, 32)}, {"w": (32, 8)}]}, {"x": (8, 16), "y": (8, 8)})
    make = (lambda s: jax.ShapeDtypeStruct(s, jnp.float32)) if abstract else (lambda s: jnp.ones(s) / 10)
    return jax.tree_util.tree_map(make, shapes, is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], int))


def test_lift_names_inputs_by_pytree_path_and_intermediates_by_source():
    prog = partir.lift(_mlp_step, *_mlp_args())
    assert prog.input_names == ("params['layers'][0]['w']", "params['layers'][1]['w']", "batch['x']", "batch['y']")
    assert prog.output_names == ("out",)
    dot = next(op for op in prog.ops if op.primitive == "dot_general")
    name = prog.name(dot.results[0])
    assert name.startswith("dot_general@test_ir.py:") and name.endswith(f"#{dot.results[0]}")
    assert prog.resolve(name) == dot.results[0]
    assert prog.value("batch['x']").shape == (8, 16)


def test_lift_abstract_args_match_concrete():
    a, b = partir.lift(_mlp_step, *_mlp_args()), partir.lift(_mlp_step, *_mlp_args(abstract=True))
    assert [v.shape for v in a.values] == [v.shape for v in b.values]
    assert a.primitives() == b.primitives()


def test_lift_records_its_origin_abstractly():
    prog = partir.lift(_mlp_step, *_mlp_args())
    assert prog.origin.fn is _mlp_step and prog.origin.static_argnums == ()
    assert prog.origin.args == _mlp_args(abstract=True)


def test_program_analyses_are_computed_once_per_program_and_arguments():
    calls = []

    def count(prog, k):
        calls.append(k)
        return len(prog.ops) * k

    a, b = partir.lift(_mlp_step, *_mlp_args()), partir.lift(_mlp_step, *_mlp_args())
    assert a.analysis(count, 2) == a.analysis(count, 2) == 2 * len(a.ops)
    a.analysis(count, 3)
    b.analysis(count, 2)
    assert calls == [2, 3, 2]


def test_unknown_name_suggests_near_misses():
    prog = partir.lift(_mlp_step, *_mlp_args())
    with pytest.raises(PartitioningError, match=r"did you mean params\['layers'\]\[1\]\['w'\]"):
        prog.resolve("params['layers'][1]['W']")


def test_path_patterns():
    name = "params['layers'][3]['mlp']['w1']"
    assert partir.path_matches("params/layers/*/mlp/w1", name)
    assert partir.path_matches("re:mlp.*w1", name)
    assert not partir.path_matches("params/layers/*/attn/*", name)


def _regions(fn, *args):
    prog = partir.lift(fn, *args)
    return prog, sorted(r.kind for r in prog.regions)


def test_lift_nested_regions_and_links():
    @jax.custom_jvp
    def cj(x):
        return jnp.sin(x)

    cj.defjvp(lambda p, t: (cj(p[0]), jnp.cos(p[0]) * t[0]))

    @jax.custom_vjp
    def cv(x):
        return x * 2

    cv.defvjp(lambda x: (cv(x), None), lambda _, g: (2 * g,))

    def f(w, xs):
        c, ys = jax.lax.scan(lambda c, x: (jnp.tanh(c @ w + x), c.sum()), xs[0], xs)
        c = jax.lax.while_loop(lambda c: c.sum() > 1, lambda c: c * 0.5, c)
        c = jax.lax.cond(c.sum() > 0, lambda a: a + 1, lambda a: a - 1, c)
        return jax.checkpoint(lambda a: cj(cv(a)))(c), ys

    prog, kinds = _regions(f, jnp.ones((4, 4)), jnp.ones((3, 2, 4)))
    for k in ("scan", "while.body", "while.cond", "cond.branch", "remat2", "custom_jvp_call", "custom_vjp_call", "top"):
        assert k in kinds, (k, kinds)
    scan = next(r for r in prog.regions if r.kind == "scan")
    assert scan.trip_count == 3 and prog.multiplicity(scan.id) == 3
    body = next(r for r in prog.regions if r.kind == "while.body")
    assert body.trip_count is None and prog.multiplicity(body.id) == 1 and prog.multiplicity(body.id, 5) == 5
    links = {op.primitive for op in prog.ops if op.link}
    assert {Link.SCAN_CARRY_LOOP, Link.SCAN_XS, Link.SCAN_YS, Link.WHILE_CARRY_LOOP, Link.COND_IN, Link.COND_OUT,
            Link.CALL_IN, Link.CALL_OUT} <= links
    assert links <= set(Link)
    xs_link = next(op for op in prog.ops if op.primitive == Link.SCAN_XS)
    assert str(xs_link.rule) == "([i, j, k]) -> ([j, k]) blocked={i}"


def test_unknown_primitive_is_replicated_with_one_warning():
    double_p = Primitive("automap_test_double")
    double_p.def_impl(lambda x: 2 * x)
    double_p.def_abstract_eval(lambda x: x)
    from jax.interpreters import mlir

    mlir.register_lowering(double_p, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))

    def f(w, x):
        return double_p.bind(double_p.bind(x @ w)) @ w.T

    w, x = jnp.arange(64.0).reshape(8, 8) / 64, jnp.ones((8, 8))
    with pytest.warns(partir.UnknownPrimitiveWarning, match="'automap_test_double' is treated as replicated") as rec:
        prog = partir.lift(f, w, x)
    assert len([r for r in rec if issubclass(r.category, partir.UnknownPrimitiveWarning)]) == 1
    assert prog.fallbacks == ("automap_test_double",)
    part = partir.Partitioning(prog, MeshSpec.of(data=8))
    part.tile("x", 0, "data")
    op = next(o for o in prog.ops if o.primitive == "automap_test_double")
    assert part.tiling(op.results[0]).is_replicated
    assert any(r.op == op.id and r.side == "operand" for r in part.reshards())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        partir.check_equivalence(f, (w, x), part)


def test_values_leaving_a_call_are_named_after_what_they_carry_out():
    def f(x):
        return jax.jit(lambda y: jnp.tanh(y) * 2.0)(x) + 1.0

    prog = partir.lift(f, jax.ShapeDtypeStruct((4,), jnp.float32))
    (call_out,) = [op.results[0] for op in prog.ops if op.primitive == Link.CALL_OUT]
    name = prog.name(call_out)
    assert name.startswith("mul@test_ir.py:") and name.endswith(f"#{call_out}"), name


def test_nested_operands_split_into_named_groups():
    from partir._nested import split_operands

    def f(w, c0, xs):
        def body(c, x):
            return (c[0] @ w + x, c[1] + 1.0), c[0].sum()

        (c, _), ys = jax.lax.scan(body, (c0, jnp.float32(0.0)), xs)
        lim = c.sum()
        c = jax.lax.while_loop(lambda c: c.sum() < lim, lambda c: c @ w + 1.0, c)
        return jax.lax.cond(lim > 0, lambda a: a @ w, lambda a: a, c), ys

    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((4,)), jnp.ones((3, 4))).jaxpr
    eqns = {e.primitive.name: e for e in jaxpr.eqns}
    scan = split_operands(eqns["scan"], eqns["scan"].invars)
    assert (len(scan.consts), len(scan.carry), len(scan.xs)) == (1, 2, 1)
    assert scan.xs[0].aval.shape == (3, 4)
    loop = split_operands(eqns["while"], eqns["while"].invars)
    assert (len(loop.cond_consts), len(loop.body_consts), len(loop.carry)) == (1, 1, 1)
    cond = split_operands(eqns["cond"], eqns["cond"].invars)
    assert len(cond.index) == 1 and cond.index[0].aval.shape == () and len(cond.operands) == 2


def test_a_nested_primitive_without_an_entry_is_a_clear_error():
    from partir._nested import nested_primitive

    with pytest.raises(PartitioningError, match=r"'shard_map' has no nested-primitive entry; known: .*scan.*while"):
        nested_primitive("shard_map")
