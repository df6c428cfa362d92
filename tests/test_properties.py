"""Generated programs: random small programs built from the supported primitives,
random `tile` actions, and the oracle (values and gradients) on the 8-device mesh, for
the jit lowering and (on half of them) the shard_map lowering.

The default suite runs a few examples; `make test-all` (profile `thorough`) runs many."""

import jax
import jax.numpy as jnp
from hypothesis import event, given
from hypothesis import strategies as st

import partir
from partir import MeshSpec, PartitioningError

MESH = MeshSpec.of(data=2, model=4)
SIZES = [4, 8, 16]
UNARY = {"tanh": jnp.tanh, "sin": jnp.sin, "neg": jnp.negative, "square": lambda x: x * x / 4,
         "gelu": lambda x: jax.nn.gelu(x), "bf16": lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)}
BINARY = {"add": jnp.add, "mul": jnp.multiply, "sub": jnp.subtract, "max": jnp.maximum}


@st.composite
def programs(draw):
    """A list of op recipes over a pool of value shapes (inputs first)."""
    shapes = [tuple(draw(st.sampled_from(SIZES)) for _ in range(draw(st.integers(2, 3)))) for _ in range(3)]
    n_inputs = len(shapes)
    recipe = []
    for _ in range(draw(st.integers(2, 9))):
        i = draw(st.integers(0, len(shapes) - 1))
        s = shapes[i]
        candidates = ["unary", "sum", "softmax", "transpose", "slice", "cumsum", "pad", "reshape", "sort"]
        same = [j for j, t in enumerate(shapes) if t == s]
        if len(same) > 1:
            candidates += ["binary", "concat"]
        if len(s) in (2, 3) and any(len(t) == 2 and t[0] == s[-1] for t in shapes):
            candidates.append("dot")
        if len(s) == 3:
            candidates.append("scan")
        if len(s) == 2 and any(len(t) == 2 and t[0] == s[0] for t in shapes):
            candidates.append("outer")
        kind = draw(st.sampled_from(candidates))
        ax = draw(st.integers(0, len(s) - 1))
        if kind == "unary":
            op, out = ("unary", draw(st.sampled_from(sorted(UNARY))), i), s
        elif kind == "binary":
            op, out = ("binary", draw(st.sampled_from(sorted(BINARY))), i, draw(st.sampled_from(same))), s
        elif kind == "concat":
            j = draw(st.sampled_from(same))
            out = tuple(n * 2 if d == ax else n for d, n in enumerate(s))
            op = ("concat", i, j, ax)
        elif kind == "dot":
            j = draw(st.sampled_from([j for j, t in enumerate(shapes) if len(t) == 2 and t[0] == s[-1]]))
            op, out = ("dot", i, j), s[:-1] + (shapes[j][1],)
        elif kind == "outer":
            j = draw(st.sampled_from([j for j, t in enumerate(shapes) if len(t) == 2 and t[0] == s[0]]))
            op, out = ("outer", i, j), (s[0], s[1], shapes[j][1])
        elif kind == "sum":
            if len(s) == 1:
                continue
            op, out = ("sum", i, ax), s[:ax] + s[ax + 1:]
        elif kind == "transpose":
            perm = tuple(draw(st.permutations(range(len(s)))))
            op, out = ("transpose", i, perm), tuple(s[p] for p in perm)
        elif kind == "slice":
            op, out = ("slice", i, ax), tuple(n // 2 if d == ax else n for d, n in enumerate(s))
        elif kind == "pad":
            op, out = ("pad", i, ax), tuple(n + 2 if d == ax else n for d, n in enumerate(s))
        elif kind == "reshape":
            if len(s) == 3:
                out = (s[0] * s[1], s[2])
            elif len(s) == 2:
                out = (s[0], 2, s[1] // 2) if s[1] >= 4 else (s[0] * s[1],)
            else:
                out = (2, s[0] // 2)
            op = ("reshape", i, out)
        elif kind == "scan":
            op, out = ("scan", i), s[1:]
        else:
            op, out = (kind, i, ax), s
        recipe.append(op)
        shapes.append(out)
    return shapes[:n_inputs], recipe


def _run(recipe, inputs):
    vals = list(inputs)
    for op in recipe:
        kind = op[0]
        if kind == "unary":
            v = UNARY[op[1]](vals[op[2]])
        elif kind == "binary":
            v = BINARY[op[1]](vals[op[2]], vals[op[3]])
        elif kind == "concat":
            v = jnp.concatenate([vals[op[1]], vals[op[2]]], op[3])
        elif kind == "dot":
            v = jnp.tanh(vals[op[1]] @ vals[op[2]])
        elif kind == "outer":
            v = vals[op[1]][:, :, None] * vals[op[2]][:, None, :]
        elif kind == "sum":
            v = jnp.sum(vals[op[1]], op[2]) / 4
        elif kind == "softmax":
            v = jax.nn.softmax(vals[op[1]], axis=op[2])
        elif kind == "transpose":
            v = jnp.transpose(vals[op[1]], op[2])
        elif kind == "slice":
            x, ax = vals[op[1]], op[2]
            v = jax.lax.slice_in_dim(x, 0, x.shape[ax] // 2, axis=ax)
        elif kind == "cumsum":
            v = jnp.cumsum(vals[op[1]], op[2]) / 8
        elif kind == "pad":
            pads = [(1, 1) if d == op[2] else (0, 0) for d in range(vals[op[1]].ndim)]
            v = jnp.pad(vals[op[1]], pads)
        elif kind == "reshape":
            v = vals[op[1]].reshape(op[2])
        elif kind == "sort":
            v = jnp.sort(vals[op[1]], op[2])
        elif kind == "scan":
            xs = vals[op[1]]
            v = jax.lax.scan(lambda c, x: (jnp.tanh(c + x), None), jnp.zeros_like(xs[0]), xs)[0]
        vals.append(v)
    return sum(jnp.mean(jnp.sin(v)) for v in vals[len(inputs):]), vals[-1]


@given(prog=programs(), actions=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2),
                                                   st.sampled_from(MESH.names)), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_random_programs_stay_equivalent(prog, actions, seed):
    shapes, recipe = prog
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    inputs = [jax.random.normal(k, s) / 2 for k, s in zip(keys, shapes)]

    def fn(*xs):
        return jax.value_and_grad(lambda xs: _run(recipe, xs)[0])(list(xs)), _run(recipe, xs)[1]

    lifted = partir.lift(fn, *inputs)
    part = partir.Partitioning(lifted, MESH)
    applied = 0
    for i, dim, axis in actions:
        try:
            part.tile(lifted.inputs[i], dim % len(shapes[i]), axis)
            applied += 1
        except PartitioningError:
            pass  # indivisible or axis taken: the action is invalid, and nothing changed
    # The first tile always applies (every size is divisible by every axis, nothing is
    # split yet), so every case tests a partitioned program.
    assert applied >= 1, actions
    event(f"{applied} of {len(actions)} tile actions applied")
    partir.check_equivalence(fn, inputs, part, rtol=1e-4, atol=1e-5)
    if seed % 2 == 0:  # the per-device lowering too, on half the programs (keeps the run short)
        partir.check_equivalence(fn, inputs, part, rtol=1e-4, atol=1e-5, backend="shard_map")
