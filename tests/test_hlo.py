"""partir._hlo: collectives counted from XLA's compiled HLO of partitioned programs.

Expected bytes are worked out by hand from the per-device (local) shapes. The XLA
rewrites asserted here were observed with JAX 0.10.2 on CPU (see each test).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from partir._hlo import Collective, collectives, collectives_of, summarize

F32 = 4


def mesh(shape=(2, 4), names=("data", "model"), order=None):
    devices = np.array(jax.devices())
    if order is not None:
        devices = devices[order]
    return Mesh(devices.reshape(shape), names)


def smap(f, m, in_specs, out_specs):
    # check_vma=False: some outputs (e.g. after all_gather) are replicated in ways
    # the checker cannot infer; the HLO is what matters here.
    return jax.jit(jax.shard_map(f, mesh=m, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def only(cols, kind=None):
    cols = [c for c in cols if kind is None or c.kind == kind]
    assert len(cols) == 1, cols
    return cols[0]


def check(c: Collective, kind, axes, group_size, shapes, result_bytes, operand_bytes, in_loop=False):
    assert (c.kind, c.axes, c.group_size) == (kind, axes, group_size), c
    assert c.shapes == tuple(shapes), c
    assert (c.result_bytes, c.operand_bytes, c.in_loop) == (result_bytes, operand_bytes, in_loop), c


X = jnp.ones((8, 32), jnp.float32)  # on a 2x4 mesh with P('data','model'): local f32[4,8] = 128 B


# --- shard_map programs, one per kind ------------------------------------------

def test_psum_over_each_axis_subset():
    m = mesh()
    cases = [("model", ("model",), 4, P("data", None)),
             ("data", ("data",), 2, P(None, "model")),
             (("data", "model"), ("data", "model"), 8, P())]
    for axis, axes, size, out in cases:
        f = smap(lambda a, axis=axis: jax.lax.psum(a, axis), m, P("data", "model"), out)
        check(only(collectives_of(f, X, mesh=m)), "all-reduce", axes, size, [("f32", (4, 8))], 4 * 8 * F32, 4 * 8 * F32)


def test_all_gather_tiled():
    m = mesh()
    f = smap(lambda a: jax.lax.all_gather(a, "model", axis=1, tiled=True), m, P("data", "model"), P("data", None))
    check(only(collectives_of(f, X, mesh=m)), "all-gather", ("model",), 4,
          [("f32", (4, 32))], 4 * 32 * F32, 4 * 8 * F32)


def test_psum_scatter_is_reduce_scatter():
    m = mesh()
    f = smap(lambda a: jax.lax.psum_scatter(a, "model", scatter_dimension=1, tiled=True),
             m, P("data", None), P("data", "model"))
    check(only(collectives_of(f, X, mesh=m)), "reduce-scatter", ("model",), 4,
          [("f32", (4, 8))], 4 * 8 * F32, 4 * 32 * F32)


def test_all_to_all_becomes_tuple_form():
    # Observed: XLA CPU splits the array all-to-all into one tuple all-to-all with
    # one f32[1,8] piece per peer (operands are the 4 row slices of the f32[4,8] block).
    m = mesh()
    f = smap(lambda a: jax.lax.all_to_all(a, "model", 0, 1, tiled=True), m, P("data", "model"), P("data", "model"))
    check(only(collectives_of(f, X, mesh=m)), "all-to-all", ("model",), 4,
          [("f32", (1, 8))] * 4, 4 * 8 * F32, 4 * 8 * F32)


def test_ppermute_is_collective_permute():
    m = mesh()
    ring = smap(lambda a: jax.lax.ppermute(a, "model", [(i, (i + 1) % 4) for i in range(4)]),
                m, P("data", "model"), P("data", "model"))
    check(only(collectives_of(ring, X, mesh=m)), "collective-permute", ("model",), 4,
          [("f32", (4, 8))], 128, 128)
    shift = smap(lambda a: jax.lax.ppermute(a, "data", [(0, 1)]), m, P("data", "model"), P("data", "model"))
    assert only(collectives_of(shift, X, mesh=m)).axes == ("data",)
    both = smap(lambda a: jax.lax.ppermute(a, ("data", "model"), [(i, (i + 1) % 8) for i in range(8)]),
                m, P("data", "model"), P("data", "model"))
    c = only(collectives_of(both, X, mesh=m))
    assert (c.axes, c.group_size) == (("data", "model"), 8)


def test_two_psums_are_combined_and_bf16_is_promoted():
    # Observed: XLA CPU combines both psums into one tuple all-reduce, and runs the
    # bf16 one in f32 (convert before and after), so the bytes are f32 bytes.
    m = mesh()
    f = smap(lambda a, b: (jax.lax.psum(a, "model"), jax.lax.psum(b, "model")), m,
             (P("data", "model"), P("data", "model")), (P("data", None), P("data", None)))
    cols = collectives_of(f, X, jnp.ones((8, 16), jnp.bfloat16), mesh=m)
    check(only(cols), "all-reduce", ("model",), 4, [("f32", (4, 8)), ("f32", (4, 4))],
          (32 + 16) * F32, (32 + 16) * F32)
    assert summarize(cols) == {("all-reduce", ("model",)): (1, 192)}


def test_long_combined_tuple_with_index_markers():
    # Seven psums become one 7-tuple all-reduce; XLA prints '/*index=5*/' inside
    # both the tuple shape and the operand list.
    m = mesh()
    f = smap(lambda *a: [jax.lax.psum(v, "model") for v in a], m, P("data", "model"), P("data", None))
    xs = [jnp.ones((8, 4 * k)) for k in range(1, 8)]  # local f32[4,k]
    c = only(collectives_of(f, *xs, mesh=m))
    check(c, "all-reduce", ("model",), 4, [("f32", (4, k)) for k in range(1, 8)], 4 * 28 * F32, 4 * 28 * F32)


def test_int8_psum_keeps_its_dtype():
    m = mesh()
    f = smap(lambda a: jax.lax.psum(a, "data"), m, P("data", "model"), P(None, "model"))
    check(only(collectives_of(f, X.astype(jnp.int8), mesh=m)), "all-reduce", ("data",), 2,
          [("s8", (4, 8))], 32, 32)


# --- plain jax.jit with shardings (GSPMD's own collectives) ---------------------

def test_jit_matmul_all_gathers():
    # a[8,16] sharded ('data','model') @ replicated w[16,32] -> replicated out: GSPMD
    # gathers a's contracting dim over 'model' (iota groups [2,4]<=[8]), then the
    # output rows over 'data' (mesh-form groups mesh[...] {'axis_0'}).
    m = mesh()
    f = jax.jit(lambda a, b: a @ b, in_shardings=(NamedSharding(m, P("data", "model")), NamedSharding(m, P())),
                out_shardings=NamedSharding(m, P()))
    cols = collectives_of(f, jnp.ones((8, 16)), jnp.ones((16, 32)), mesh=m)
    assert len(cols) == 2, cols
    check(cols[0], "all-gather", ("model",), 4, [("f32", (4, 16))], 4 * 16 * F32, 4 * 4 * F32)
    check(cols[1], "all-gather", ("data",), 2, [("f32", (8, 32))], 8 * 32 * F32, 4 * 32 * F32)
    assert summarize(cols) == {("all-gather", ("model",)): (1, 256), ("all-gather", ("data",)): (1, 1024)}


def test_jit_reduce_scatter_is_all_reduce_plus_slice_on_cpu():
    # Contracting a 'model'-sharded dim into a 'model'-sharded output is a
    # reduce-scatter in principle; XLA CPU emits a full all-reduce then a
    # dynamic-slice (it has no reduce-scatter-creator pass).
    m = mesh()
    f = jax.jit(lambda a, b: a @ b,
                in_shardings=(NamedSharding(m, P(None, "model")), NamedSharding(m, P("model", None))),
                out_shardings=NamedSharding(m, P(None, "model")))
    cols = collectives_of(f, jnp.ones((8, 16)), jnp.ones((16, 32)), mesh=m)
    check(only(cols), "all-reduce", ("model",), 4, [("f32", (8, 32))], 8 * 32 * F32, 8 * 32 * F32)


# --- loops ----------------------------------------------------------------------

def test_collectives_in_scan_and_fori_loop_are_in_loop():
    m = mesh()

    def scanned(a):
        a = jax.lax.psum(a, "data")  # outside the loop
        body = lambda c, _: (jax.lax.psum(c, "model") * 0.5, None)
        return jax.lax.scan(body, a, None, length=3)[0]

    cols = collectives_of(smap(scanned, m, P("data", "model"), P(None, None)), X, mesh=m)
    assert sorted((c.axes, c.in_loop) for c in cols) == [(("data",), False), (("model",), True)]
    assert len({c.computation for c in cols}) == 2

    def looped(a):
        step = lambda i, c: jax.lax.all_gather(c, "model", axis=1, tiled=True)[:, :8] * 2
        return jax.lax.fori_loop(0, 3, step, a)

    c = only(collectives_of(smap(looped, m, P("data", "model"), P("data", "model")), X, mesh=m))
    check(c, "all-gather", ("model",), 4, [("f32", (4, 32))], 512, 128, in_loop=True)


# --- device ids and other meshes --------------------------------------------------

def test_device_ids_are_positions_in_the_mesh():
    # A mesh over a permuted device list compiles to the same HLO (logical ids are
    # positions in mesh.devices.flat), and the executable runs logical id i on
    # mesh.devices.flat[i].
    plain, perm = mesh(), mesh(order=[1, 0, 3, 2, 5, 4, 7, 6])
    prog = lambda a: jax.lax.ppermute(jax.lax.psum(a, "data"), "model", [(i, (i + 1) % 4) for i in range(4)])
    outs = []
    for m in (plain, perm):
        f = smap(prog, m, P("data", "model"), P(None, "model"))
        outs.append(collectives_of(f, X, mesh=m))
        assert f.lower(X).compile().runtime_executable().local_devices() == list(m.devices.flat)
    assert outs[0] == outs[1]
    assert [(c.kind, c.axes) for c in outs[1]] == [("all-reduce", ("data",)), ("collective-permute", ("model",))]


def test_1x8_mesh():
    m = mesh((1, 8))
    x = jnp.ones((8, 16))  # local f32[8,2]
    for axis in ("model", ("data", "model")):
        # Groups over both axes equal groups over 'model' alone: the fewest axes win.
        f = smap(lambda a, axis=axis: jax.lax.psum(a, axis), m, P("data", "model"), P("data", None))
        check(only(collectives_of(f, x, mesh=m)), "all-reduce", ("model",), 8, [("f32", (8, 2))], 64, 64)
    f = jax.jit(lambda a, b: a @ b, in_shardings=(NamedSharding(m, P("data", "model")), NamedSharding(m, P())),
                out_shardings=NamedSharding(m, P()))
    c = only(collectives_of(f, x, jnp.ones((16, 32)), mesh=m))
    check(c, "all-gather", ("model",), 8, [("f32", (8, 16))], 8 * 16 * F32, 8 * 2 * F32)


def test_4x2_mesh():
    m = mesh((4, 2))
    f = smap(lambda a: jax.lax.psum(a, "data"), m, P("data", "model"), P(None, "model"))
    check(only(collectives_of(f, X, mesh=m)), "all-reduce", ("data",), 4, [("f32", (2, 16))], 128, 128)
    f = jax.jit(lambda a, b: a @ b, in_shardings=(NamedSharding(m, P("data", "model")), NamedSharding(m, P())),
                out_shardings=NamedSharding(m, P()))
    cols = collectives_of(f, jnp.ones((8, 16)), jnp.ones((16, 32)), mesh=m)
    assert [(c.kind, c.axes, c.group_size, c.result_bytes, c.operand_bytes) for c in cols] == [
        ("all-gather", ("model",), 2, 2 * 16 * F32, 2 * 8 * F32),
        ("all-gather", ("data",), 4, 8 * 32 * F32, 2 * 32 * F32)]


def test_3_axis_mesh():
    m = mesh((2, 2, 2), ("a", "b", "c"))
    x = jnp.ones((8, 16))  # P(('a','b','c')) -> local f32[1,16]
    f = smap(lambda v: jax.lax.psum(v, ("a", "c")), m, P(("a", "b", "c")), P("b"))
    check(only(collectives_of(f, x, mesh=m)), "all-reduce", ("a", "c"), 4, [("f32", (1, 16))], 64, 64)
    f = smap(lambda v: jax.lax.all_gather(v, ("c", "a"), tiled=True), m, P(("a", "b", "c")), P("b"))
    check(only(collectives_of(f, x, mesh=m)), "all-gather", ("a", "c"), 4, [("f32", (4, 16))], 256, 64)
    # GSPMD's mesh-form groups with an explicit device order: device_ids=([4,2]T(1,0)).
    f = jax.jit(lambda a, b: a @ b, in_shardings=(NamedSharding(m, P(None, "b")), NamedSharding(m, P("b", None))),
                out_shardings=NamedSharding(m, P()))
    c = only(collectives_of(f, x, jnp.ones((16, 32)), mesh=m))
    check(c, "all-reduce", ("b",), 2, [("f32", (8, 32))], 1024, 1024)


# --- hand-written HLO: async forms and group spellings not produced on CPU -------

ASYNC_HLO = """\
HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%branch (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar.b = f32[8]{0} all-reduce(%p), channel_id=9, replica_groups={}, to_apply=%add
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %c = f32[8]{0} conditional(%i, %v, %v), branch_computations={%branch, %branch}
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %c)
}

%cond (t.1: (s32[], f32[8])) -> pred[] {
  %t.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (a: f32[4,8], b: bf16[16], t0: (s32[], f32[8])) -> f32[16,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = bf16[16]{0} parameter(1)
  %t0 = (s32[], f32[8]{0}) parameter(2)
  %ars = f32[4,8]{1,0} all-reduce-start(%a), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  %ard = f32[4,8]{1,0} all-reduce-done(%ars)
  %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(f32[4,8]{1,0} %ard), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %agd = f32[16,8]{1,0} all-gather-done(%ags)
  %cps = (bf16[16]{0}, bf16[16]{0}, u32[], u32[]) collective-permute-start(%b), channel_id=3, source_target_pairs={{0,4},{4,0}}
  %cpd = bf16[16]{0} collective-permute-done(%cps)
  %rs = (f32[1,8]{1,0}, bf16[4]{0}) reduce-scatter(%a, %cpd), channel_id=4, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, to_apply=%add
  %aa = f32[4,8]{1,0} all-to-all(%a), channel_id=5, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1':(1)2}, dimensions={0}
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body
  ROOT %out = f32[16,8]{1,0} copy(%agd)
}
"""


def test_async_forms_and_group_spellings():
    cols = {c.name: c for c in collectives(ASYNC_HLO, mesh())}
    assert sorted(cols) == ["aa", "ags", "ar.b", "ars", "cps", "rs"]  # no -done
    check(cols["ars"], "all-reduce", ("model",), 4, [("f32", (4, 8))], 128, 128)
    # all-gather-start returns (operand, result): only the result counts.
    check(cols["ags"], "all-gather", ("data",), 2, [("f32", (16, 8))], 512, 128)
    # collective-permute-start returns (operand, result, u32[], u32[]).
    check(cols["cps"], "collective-permute", ("data",), 2, [("bf16", (16,))], 32, 32)
    check(cols["rs"], "reduce-scatter", (), 2, [("f32", (1, 8)), ("bf16", (4,))], 32 + 8, 128 + 32)
    # Sub-axis 'axis_1':(1)2 = the minor half of the size-4 axis: no mesh axis matches.
    check(cols["aa"], "all-to-all", (), 2, [("f32", (4, 8))], 128, 128)
    # replica_groups={} is one group of all devices; a conditional inside a while body.
    check(cols["ar.b"], "all-reduce", ("data", "model"), 8, [("f32", (8,))], 32, 32, in_loop=True)
    assert cols["ar.b"].computation == "branch" and cols["ars"].computation == "main"


def test_mesh_form_groups_with_device_ids_and_unquoted_names():
    line = "  %r = f32[2]{0} all-reduce(%p), replica_groups=mesh[x=2,y=4], device_ids=([4,2]T(1,0)) {x}, to_apply=%add"
    text = f"ENTRY %main (p: f32[2]) -> f32[2] {{\n  %p = f32[2]{{0}} parameter(0)\n{line}\n}}\n"
    # ids = iota(8).reshape(4,2).T -> [[0,2,4,6],[1,3,5,7]]; varying x pairs {0,1},{2,3},...
    c = only(collectives(text, mesh((4, 2))))
    assert (c.axes, c.group_size, c.in_loop) == (("model",), 2, False)


def test_summarize_counts_and_bytes():
    cols = collectives(ASYNC_HLO, mesh())
    assert summarize(cols) == {
        ("all-reduce", ("model",)): (1, 128), ("all-gather", ("data",)): (1, 512),
        ("collective-permute", ("data",)): (1, 32), ("reduce-scatter", ()): (1, 40),
        ("all-to-all", ()): (1, 128), ("all-reduce", ("data", "model")): (1, 32)}
