"""Actions and propagation: what a `tile` decides, what it leaves to reshard, undo."""

import jax
import jax.numpy as jnp
import pytest

import partir
from partir import MeshSpec, PartitioningError, Tiling
from examples import gpt

MESH = MeshSpec.of(data=2, model=4)


def _mlp(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def _mlp_prog():
    return partir.lift(_mlp, {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 8))}, jnp.ones((8, 16)))


def _dots(prog):
    return [op for op in prog.ops if op.primitive == "dot_general"]


def test_column_split_propagates_to_row_split_and_a_reduction():
    prog = _mlp_prog()
    part = partir.Partitioning(prog, MESH)
    part.tile("params['w1']", 1, "model")
    assert part.tiling("params['w2']") == Tiling((("model",), ()))
    first, second = _dots(prog)
    assert part.tiling(first.results[0]) == Tiling(((), ("model",)))
    # The second matmul contracts the split dim: its result is partial over 'model'.
    assert part.produced(second.results[0]) == Tiling(((), ()), ("model",))
    (red,) = part.reshards()
    assert (red.op, red.side) == (second.id, "result")
    assert [str(t) for t in partir.transition(red.src, red.dst, MESH)] == ["all-reduce(model)"]


def test_conflict_keeps_earlier_decision_and_records_a_reshard():
    prog = _mlp_prog()
    part = partir.Partitioning(prog, MESH)
    part.tile("x", 0, "data")
    part.tile("params['w1']", 0, "data")  # contracting dim: 'data' already splits the batch factor
    first = _dots(prog)[0]
    assert part.factor_tiling(first.id)[first.rule.names.index("i")] == ("data",)
    assert part.tiling(first.results[0]) == Tiling((("data",), ()))
    (rs,) = [r for r in part.reshards() if r.op == first.id]
    assert rs.value == prog.resolve("params['w1']") and rs.side == "operand"
    assert rs.src == Tiling((("data",), ())) and rs.dst == Tiling.replicated(2)
    assert [str(t) for t in partir.transition(rs.src, rs.dst, MESH)] == ["all-gather(data)"]


def test_pinned_value_is_resharded_not_split():
    prog = _mlp_prog()
    part = partir.Partitioning(prog, MESH)
    part.replicate("params['w2']")
    part.tile("params['w1']", 1, "model")
    assert part.tiling("params['w2']").is_replicated
    second = _dots(prog)[1]
    assert any(r.op == second.id and r.value == prog.resolve("params['w2']") for r in part.reshards())
    with pytest.raises(PartitioningError, match="pinned"):
        part.tile("params['w2']", 0, "model")


@pytest.mark.parametrize("args,match", [
    (("params['w1']", 2, "model"), "out of range"),
    (("params['w1']", 0, "expert"), "not in the mesh"),
    (("x", 0, "model"), None),
])
def test_tile_errors_change_nothing(args, match):
    prog = _mlp_prog()
    part = partir.Partitioning(prog, MESH)
    part.tile("x", 1, "model")
    before = (part.key(), partir.dump(part))
    if match is None:  # 'model' already splits dim 1 of x
        with pytest.raises(PartitioningError, match="already uses that axis"):
            part.tile(*args)
    else:
        with pytest.raises(PartitioningError, match=match):
            part.tile(*args)
    assert (part.key(), partir.dump(part)) == before


def test_redo_of_an_unknown_action_is_an_error_that_changes_nothing():
    part = partir.Partitioning(_mlp_prog(), MESH)
    part.tile("x", 0, "data")
    before = (part.key(), part.decisions)
    with pytest.raises(PartitioningError, match="unknown decision action 'shard'; the known actions are tile, "
                                                "replicate, constrain, pin"):
        part.redo(partir.Decision("shard", part.program.resolve("x"), 1, "model", "user"))
    assert (part.key(), part.decisions) == before


def test_indivisible_dim_is_rejected():
    prog = partir.lift(lambda w: w * 2, jnp.ones((6, 8)))
    part = partir.Partitioning(prog, MESH)
    with pytest.raises(PartitioningError, match=r"dim 0 \(size 6\) over 'model': 4 devices do not divide it"):
        part.tile("w", 0, "model")


def test_rollback_restores_state_and_key():
    prog = _mlp_prog()
    part = partir.Partitioning(prog, MESH)
    part.tile("x", 0, "data")
    key, text = part.key(), partir.dump(part)
    mark = part.mark()
    part.tile("params['w1']", 1, "model")
    assert part.key() != key
    vals, ops = part.changed_since(mark)
    assert prog.resolve("params['w2']") in vals and ops
    part.rollback(mark)
    assert part.key() == key and partir.dump(part) == text and len(part.decisions) == 1


def test_same_actions_same_state():
    a, b = partir.Partitioning(_mlp_prog(), MESH), partir.Partitioning(_mlp_prog(), MESH)
    for p in (a, b):
        p.tile("x", 0, "data")
        p.tile("params['w1']", 1, "model")
    assert a.key() == b.key() and partir.dump(a) == partir.dump(b)


def test_reshape_carries_head_split_and_blocks_what_it_cannot():
    def attn(wq, x):
        q = (x @ wq).reshape(2, 4, 8, 8)  # [B, S, H, Dh]
        return jnp.einsum("bshd,bthd->bhst", q, q)

    prog = partir.lift(attn, jnp.ones((16, 64)), jnp.ones((2, 4, 16)))
    part = partir.Partitioning(prog, MESH)
    part.tile("wq", 1, "model")
    scores = next(op for op in prog.ops if op.primitive == "dot_general" and len(prog.values[op.results[0]].shape) == 4)
    assert part.tiling(scores.results[0]) == Tiling(((), ("model",), (), ()))
    # 8 heads x 8 dims: an 8-way split of H*Dh maps onto H only when 8 divides H.
    part8 = partir.Partitioning(prog, MeshSpec.of(model=8))
    part8.tile("wq", 1, "model")
    assert part8.tiling(scores.results[0]).dims[1] == ("model",)


def test_scan_carry_keeps_one_tiling_and_stacked_params_split_inside():
    def f(ws, x):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    prog = partir.lift(f, jnp.ones((3, 16, 16)), jnp.ones((8, 16)))
    part = partir.Partitioning(prog, MESH)
    part.tile("x", 0, "data")
    body = next(r for r in prog.regions if r.kind == "scan")
    carry_in, w_in = body.invars
    assert part.tiling(carry_in) == part.tiling(body.outvars[0]) == Tiling((("data",), ()))
    assert part.tiling(prog.outputs[0]) == Tiling((("data",), ()))
    part.tile("ws", 2, "model")
    assert part.tiling(w_in) == Tiling(((), ("model",)))
    with pytest.raises(PartitioningError):
        part.tile("ws", 0, "model")  # 'model' is taken; and the layer dim is blocked anyway
    part2 = partir.Partitioning(prog, MeshSpec.of(layers=3))
    part2.tile("ws", 0, "layers")  # allowed on the value, never propagated into the body
    assert part2.tiling(w_in).is_replicated
    assert any(prog.ops[r.op].primitive == partir.Link.SCAN_XS for r in part2.reshards())


def test_tiling_one_layer_touches_only_that_layer():
    step, args = gpt.make_train_step(gpt.GPTConfig(n_layers=4), abstract=True)
    prog = partir.lift(step, *args)
    part = partir.Partitioning(prog, MESH)
    mark = part.mark()
    part.tile("params['layers'][2]['mlp']['w1']", 1, "model")
    vals, ops = part.changed_since(mark)
    names = {prog.name(v) for v in vals if v in prog.inputs}
    assert names == {"params['layers'][2]['mlp']['w1']", "params['layers'][2]['mlp']['b1']",
                     "params['layers'][2]['mlp']['w2']", "opt_state[0].mu['layers'][2]['mlp']['w1']",
                     "opt_state[0].mu['layers'][2]['mlp']['b1']", "opt_state[0].mu['layers'][2]['mlp']['w2']",
                     "opt_state[0].nu['layers'][2]['mlp']['w1']", "opt_state[0].nu['layers'][2]['mlp']['b1']",
                     "opt_state[0].nu['layers'][2]['mlp']['w2']"}
    assert len(ops) < len(prog.ops) / 8


def _gpt_part():
    step, args = gpt.make_train_step(gpt.GPTConfig(n_layers=2), abstract=True)
    return partir.Partitioning(partir.lift(step, *args), MESH)


def _state(part):
    return part.key(), partir.dump(part), part.decisions, part.rematerialized, [part.is_pinned(v)
                                                                                for v in part.program.inputs]


def test_a_replayed_delta_reaches_the_state_the_actions_did_and_rolls_back():
    import tactics

    part = _gpt_part()
    part.tile("batch['tokens']", 0, "data")
    before, start = _state(part), part.key()
    mark = part.mark()
    # Every kind of change: tiles and factor tilings, a pin, a boundary, remat.
    part.replicate("params['ln_f']['bias']")
    part.constrain("params['ln_f']['scale']", Tiling(((),)))
    for t in (tactics.Megatron("model"), tactics.FSDP("data"), tactics.Remat("dots")):
        part, _ = t.apply(part, tactics.Context())
    after = _state(part)
    delta = part.delta(mark, start)
    part.rollback(mark)
    assert _state(part) == before
    part.replay(delta)
    assert _state(part) == after
    part.rollback(mark)
    assert _state(part) == before


def test_a_delta_replays_only_on_the_state_it_was_recorded_from():
    part = _gpt_part()
    mark, start = part.mark(), part.key()
    part.tile("batch['tokens']", 0, "data")
    delta = part.delta(mark, start)
    with pytest.raises(PartitioningError, match="replays only on the state it was recorded from"):
        part.replay(delta)


def test_rollback_after_rollbacks_to_other_marks_restores_the_key():
    # Marks taken, undone and taken again at the same log length: each rollback must
    # restore the key of the state its own mark saw.
    part = _gpt_part()
    outer = part.mark()
    part.tile("batch['tokens']", 0, "data")
    inner = part.mark()
    part.tile("params['layers'][0]['mlp']['w1']", 1, "model")
    part.rollback(outer)
    part.tile("params['layers'][0]['mlp']['w1']", 0, "data")
    again = part.mark()
    state = _state(part)
    part.tile("params['head']['w']", 1, "model")
    part.rollback(again)
    assert _state(part) == state
    fresh = partir.Partitioning(part.program, MESH)
    for d in part.decisions:
        fresh.redo(d)
    assert (part.key(), partir.dump(part)) == (fresh.key(), partir.dump(fresh)) and inner >= again
