"""Generated programs for the property tests and `make fuzz`.

A case is plain JSON data (so a failing one can be saved and replayed): a mesh of 1 to
3 axes, the inputs (`params` floats and a `batch` of a float `x` and int32 `ids`), a
recipe of ops over a pool of values (inputs first, each op adds one), a plan (random
`tile` actions, a random schedule of tactics, or a short search, each after one tile
that can apply) and a seed for the input values. `check_case` builds the train step
`(params, batch) -> (params - 0.1 * grads, loss, last value)`, partitions it as the plan
says and checks it against `jax.jit` (values and gradients) on the simulated devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

import partir
import search
import tactics as T
from partir import MeshSpec, PartitioningError

SIZES = (4, 8, 16, 6)  # 6: some splits over 4 or 8 devices are refused
MESHES = ((("data", 2), ("model", 4)), (("x", 2), ("y", 2), ("z", 2)), (("data", 4), ("model", 2)), (("a", 8),),
          (("a", 2), ("b", 2)), (("a", 4),), (("a", 2),))  # hypothesis draws the first ones more
F32, I32 = "f32", "i32"
BF16 = jnp.bfloat16
UNARY = {"tanh": jnp.tanh, "sin": jnp.sin, "neg": jnp.negative, "square": lambda x: x * x / 4,
         "gelu": jax.nn.gelu, "bf16": lambda x: x.astype(BF16).astype(jnp.float32),
         "bf16_tanh": lambda x: jnp.tanh(x.astype(BF16)).astype(jnp.float32)}
BINARY = {"add": jnp.add, "mul": jnp.multiply, "sub": jnp.subtract, "max": jnp.maximum}
INT_UNARY = {"affine": lambda v: (v * 3 + 1) % 7, "half": lambda v: v // 2, "neg": jnp.negative}
POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_saveable,
            "nothing": jax.checkpoint_policies.nothing_saveable}


# -- drawing a case -------------------------------------------------------------------
def _shape(draw, rank_min=1, rank_max=3):
    return tuple(draw(st.sampled_from(SIZES)) for _ in range(draw(st.integers(rank_min, rank_max))))


def _of(pool, dtype, pred=lambda s: True):
    return [i for i, (s, d) in enumerate(pool) if d == dtype and pred(s)]


def _dot(draw, pool, i):
    a = pool[i][0]
    ca = draw(st.integers(0, len(a) - 1))
    partners = [(j, cb) for j in _of(pool, F32) for cb, n in enumerate(pool[j][0]) if n == a[ca]]
    j, cb = draw(st.sampled_from(partners))
    b = pool[j][0]
    batch = [(x, y) for x in range(len(a)) for y in range(len(b)) if x != ca and y != cb and a[x] == b[y]]
    ba, bb = draw(st.sampled_from(batch)) if batch and draw(st.booleans()) else (None, None)
    free_a = [n for d, n in enumerate(a) if d not in (ca, ba)]
    free_b = [n for d, n in enumerate(b) if d not in (cb, bb)]
    out = ([a[ba]] if ba is not None else []) + free_a + free_b
    if not out or len(out) > 4:
        return None
    bf16 = draw(st.sampled_from([False, False, True]))  # bf16 cases get a looser oracle: keep them fewer
    return ["dot", i, j, ca, cb, ba, bb, bf16], (tuple(out), F32)


def _float_op(draw, pool, i, kind):
    s = pool[i][0]
    ax = draw(st.integers(0, len(s) - 1))
    ints = _of(pool, I32)
    if kind in ("unary", "softmax", "cumsum", "sort", "cond"):
        name = draw(st.sampled_from(sorted(UNARY))) if kind == "unary" else None
        return [kind, i, ax, name], (s, F32)
    if kind == "binary":
        j = draw(st.sampled_from(_of(pool, F32, lambda t: t == s)))
        return ["binary", draw(st.sampled_from(sorted(BINARY))), i, j], (s, F32)
    if kind == "sum":
        return ["sum", i, ax], (s[:ax] + s[ax + 1:], F32)
    if kind == "transpose":
        perm = list(draw(st.permutations(range(len(s)))))
        return ["transpose", i, perm], (tuple(s[p] for p in perm), F32)
    if kind == "slice":
        return ["slice", i, ax], (s[:ax] + (s[ax] // 2,) + s[ax + 1:], F32)
    if kind == "pad":
        lo, hi, interior = draw(st.integers(0, 2)), draw(st.integers(0, 2)), draw(st.integers(0, 1))
        n = lo + hi + s[ax] + interior * (s[ax] - 1)
        return ["pad", i, ax, lo, hi, interior], (s[:ax] + (n,) + s[ax + 1:], F32)
    if kind == "concat":
        others = draw(st.lists(st.sampled_from(_of(pool, F32, lambda t: t == s)), min_size=1, max_size=2))
        return ["concat", [i, *others], ax], (s[:ax] + (s[ax] * (1 + len(others)),) + s[ax + 1:], F32)
    if kind == "split":
        ax, a = draw(st.sampled_from([(d, k) for d, n in enumerate(s) for k in (2, 4) if n % k == 0 and n > k]))
        return ["split", i, ax, a], (s[:ax] + (a, s[ax] // a) + s[ax + 1:], F32)
    if kind == "merge":
        ax = min(ax, len(s) - 2)
        return ["merge", i, ax], (s[:ax] + (s[ax] * s[ax + 1],) + s[ax + 2:], F32)
    if kind == "dot":
        return _dot(draw, pool, i)
    if kind in ("dslice", "dupdate", "while"):
        k = draw(st.sampled_from(ints))
        out = s[:ax] + (s[ax] // 2,) + s[ax + 1:] if kind == "dslice" else s
        return [kind, i, ax, k], (out, F32)
    if kind == "scan":
        return ["scan", i], (s[1:], F32)
    if kind == "remat":
        return ["remat", i, draw(st.sampled_from(sorted(POLICIES)))], (s, F32)
    if kind == "argmax":
        return ["argmax", i, ax], (s[:ax] + s[ax + 1:], I32)
    if kind in ("gather", "scatter"):
        k = draw(st.sampled_from(ints))
        out = pool[k][0] + (s[1],) if kind == "gather" else s
        return [kind, i, k], (out, F32)
    raise AssertionError(kind)


def _int_op(draw, pool, i, kind):
    s = pool[i][0]
    if kind == "iunary":
        return ["iunary", draw(st.sampled_from(sorted(INT_UNARY))), i], (s, I32)
    if kind == "isum":
        ax = draw(st.integers(0, len(s) - 1))
        return ["isum", i, ax], (s[:ax] + s[ax + 1:], I32)
    return ["float", i], (s, F32)


def _kinds(pool, i) -> list[str]:
    s, dtype = pool[i]
    if dtype == I32:
        return ["iunary", "float"] + (["isum"] if len(s) >= 2 else [])
    # The ops that move data between devices most come twice: drawn more often.
    kinds = ["unary", "softmax", "cumsum", "sort", "cond", "transpose", "slice", "remat", "dupdate", "while",
             "binary", "concat", "pad", "dslice", "dot"] + ["binary", "concat", "pad", "dslice", "dot", "dot"]
    kinds += ["sum", "scan", "merge", "argmax"] if len(s) >= 2 else []
    if len(s) <= 3 and any(n % k == 0 and n > k for n in s for k in (2, 4)):
        kinds.append("split")
    if len(s) == 2:
        kinds += ["gather", "scatter"] * 2
    return kinds


@st.composite
def cases(draw, plans=("schedule", "tiles", "search")):
    """A case (see the module docstring) as JSON data."""
    n_params = draw(st.integers(1, 3))
    pool = [(_shape(draw, 2, 3), F32) for _ in range(n_params)]
    pool += [(_shape(draw, 1, 3), F32), (_shape(draw, 1, 2), I32)]
    n_inputs = len(pool)
    recipe = []
    for _ in range(draw(st.integers(1, 7))):
        i = draw(st.integers(0, len(pool) - 1))
        kind = draw(st.sampled_from(_kinds(pool, i)))
        made = (_int_op if pool[i][1] == I32 else _float_op)(draw, pool, i, kind)
        if made is not None and max(made[1][0] or (1,)) <= 64 and len(made[1][0]) <= 4:
            recipe.append(made[0])
            pool.append(made[1])
    if not recipe:  # every drawn op was too big: one that is not, so the step has a last value
        recipe.append(["unary", 0, 0, "tanh"])
    mesh = draw(st.sampled_from(MESHES))
    inputs = [[list(s), d] for s, d in pool[:n_inputs]]
    if not any(n % k == 0 for s, _ in inputs for n in s for _, k in mesh):
        mesh = (("a", 2),)  # 8 devices split no dim of 4 or 6: a mesh where a first tile applies
    return {"mesh": [list(a) for a in mesh], "params": n_params, "inputs": inputs, "recipe": recipe,
            "plan": _plan(draw, draw(st.sampled_from(plans)), inputs, mesh), "seed": draw(st.integers(0, 2**16))}


def input_names(case) -> list[str]:
    """The inputs' glob names, in order: params/w0.., batch/x, batch/ids."""
    return [f"params/w{i}" for i in range(case["params"])] + ["batch/x", "batch/ids"]


def _plan(draw, kind, inputs, mesh) -> dict:
    axes = [a for a, _ in mesh]
    sizes = dict(mesh)
    valid = [(i, d, a) for i, (s, _) in enumerate(inputs) for d, n in enumerate(s) for a in axes if n % sizes[a] == 0]
    first = list(draw(st.sampled_from(valid)))  # a tile that applies: every case partitions something
    tile = st.tuples(st.integers(0, len(inputs) - 1), st.integers(0, 2), st.sampled_from(axes)).map(list)
    plan = {"kind": kind, "first": first, "tiles": draw(st.lists(tile, max_size=3))}
    if kind == "schedule":
        word = st.sampled_from(["dp", "megatron", "fsdp", "zero1", "zero2", "sp", "replicate"])
        plan["tactics"] = draw(st.lists(st.tuples(word, st.sampled_from(axes), st.integers(0, len(inputs) - 1))
                                        .map(list), min_size=1, max_size=3))
    if kind in ("schedule", "search"):
        plan["search"] = kind == "search" or draw(st.booleans())
        plan["episodes"], plan["search_seed"] = draw(st.integers(1, 6)), draw(st.integers(0, 99))
    return plan


#: Every op kind the generator makes.
KINDS = ("unary", "binary", "softmax", "cumsum", "sort", "sum", "transpose", "slice", "pad", "concat", "split",
         "merge", "dot", "dslice", "dupdate", "while", "cond", "scan", "remat", "argmax", "gather", "scatter",
         "iunary", "isum", "float")


def _example(mesh, params, inputs, recipe, plan) -> dict:
    return {"mesh": mesh, "params": params, "inputs": inputs, "recipe": recipe, "plan": plan, "seed": 0}


#: Hand-made cases that together use every op kind, one per plan kind: `make test`
#: checks them all every time, whatever hypothesis draws.
EXAMPLES = {
    "loops": _example(
        [["data", 2], ["model", 4]], 2, [[[8, 16], F32], [[16, 8], F32], [[4, 8, 16], F32], [[8], I32]],
        [["dot", 2, 0, 2, 1, None, None, False], ["scan", 4], ["while", 5, 0, 3], ["cond", 6, 0, None],
         ["remat", 7, "dots"], ["dslice", 8, 1, 3], ["dupdate", 8, 0, 3], ["cumsum", 10, 1, None],
         ["sort", 11, 0, None]],
        {"kind": "schedule", "first": [2, 0, "data"], "tiles": [], "tactics": [["megatron", "model", 0]],
         "search": False, "episodes": 1, "search_seed": 0}),
    "embedding": _example(
        [["x", 2], ["y", 2], ["z", 2]], 2, [[[16, 8], F32], [[8, 8], F32], [[8, 8], F32], [[4, 8], I32]],
        [["gather", 0, 3], ["scatter", 0, 3], ["argmax", 2, 1], ["gather", 1, 6], ["iunary", "affine", 3],
         ["isum", 8, 0], ["float", 9], ["softmax", 7, 1, None], ["sum", 4, 2]],
        {"kind": "tiles", "first": [0, 0, "x"], "tiles": [[3, 0, "y"], [1, 1, "z"]]}),
    "shapes": _example(
        [["data", 4], ["model", 2]], 2, [[[4, 8, 16], F32], [[4, 16, 8], F32], [[8, 16], F32], [[8], I32]],
        [["dot", 0, 1, 2, 1, 0, 0, False], ["split", 2, 1, 4], ["merge", 5, 1], ["pad", 6, 1, 1, 2, 1],
         ["concat", [2, 6], 0], ["transpose", 4, [2, 0, 1]], ["binary", "mul", 2, 6], ["unary", 10, 0, "gelu"],
         ["slice", 8, 0]],
        {"kind": "search", "first": [2, 0, "data"], "tiles": [[0, 1, "model"]], "search": True, "episodes": 4,
         "search_seed": 0}),
}


# -- running a case -------------------------------------------------------------------
def _run_op(op, vals):
    kind, i = op[0], op[1] if op[0] not in ("binary", "iunary") else op[2]
    if kind == "binary":
        return BINARY[op[1]](vals[op[2]], vals[op[3]])
    if kind == "iunary":
        return INT_UNARY[op[1]](vals[op[2]])
    x = vals[i] if isinstance(i, int) else None
    simple = {"softmax": lambda: jax.nn.softmax(x, axis=op[2]), "cumsum": lambda: jnp.cumsum(x, op[2]) / 8,
              "sort": lambda: jnp.sort(x, op[2]), "sum": lambda: jnp.sum(x, op[2]) / 4,
              "transpose": lambda: jnp.transpose(x, op[2]), "argmax": lambda: jnp.argmax(x, op[2]).astype(jnp.int32),
              "slice": lambda: jax.lax.slice_in_dim(x, 0, x.shape[op[2]] // 2, axis=op[2]),
              "isum": lambda: jnp.sum(x, op[2]), "float": lambda: x.astype(jnp.float32) / 4,
              "unary": lambda: UNARY[op[3]](x) if op[3] else x}
    if kind in simple:
        return simple[kind]()
    if kind == "pad":
        cfg = [(op[3], op[4], op[5]) if d == op[2] else (0, 0, 0) for d in range(x.ndim)]
        return jax.lax.pad(x, jnp.float32(0.5), cfg)
    if kind == "concat":
        return jnp.concatenate([vals[j] for j in op[1]], op[2])
    if kind == "split":
        ax, a = op[2], op[3]
        return x.reshape(x.shape[:ax] + (a, x.shape[ax] // a) + x.shape[ax + 1:])
    if kind == "merge":
        ax = op[2]
        return x.reshape(x.shape[:ax] + (x.shape[ax] * x.shape[ax + 1],) + x.shape[ax + 2:])
    return _run_structured(op, vals, x)


def _run_structured(op, vals, x):
    kind = op[0]
    if kind == "dot":
        _, i, j, ca, cb, ba, bb, bf16 = op
        a, b = (x.astype(BF16), vals[j].astype(BF16)) if bf16 else (x, vals[j])
        batch = ((ba,), (bb,)) if ba is not None else ((), ())
        return jnp.tanh(jax.lax.dot_general(a, b, (((ca,), (cb,)), batch), preferred_element_type=jnp.float32))
    if kind in ("dslice", "dupdate", "while"):
        ax, count = op[2], jnp.sum(vals[op[3]])
        n = x.shape[ax]
        if kind == "while":
            trips = 1 + count % 3
            return jax.lax.while_loop(lambda c: c[0] < trips, lambda c: (c[0] + 1, jnp.tanh(c[1]) * 0.9 + 0.1),
                                      (jnp.int32(0), jax.lax.stop_gradient(x)))[1]
        start = count % (n - n // 2 + 1)
        if kind == "dslice":
            return jax.lax.dynamic_slice_in_dim(x, start, n // 2, op[2])
        part = jnp.tanh(jax.lax.slice_in_dim(x, 0, n // 2, axis=ax))
        return jax.lax.dynamic_update_slice_in_dim(x, part, start, ax)
    if kind == "cond":
        return jax.lax.cond(jnp.sum(x) > 0, lambda v: jnp.tanh(v) * 2, jnp.sin, x)
    if kind == "scan":
        def body(c, row):
            return jnp.tanh(c + row), c * row
        carry, ys = jax.lax.scan(body, jnp.zeros_like(x[0]), x)
        return carry + ys.mean(0)
    if kind == "remat":
        return jax.checkpoint(lambda v: jnp.sin(v) * jnp.tanh(v), policy=POLICIES[op[2]])(x)
    if kind == "gather":
        return x[vals[op[2]]]
    if kind == "scatter":
        ids = vals[op[2]]
        return x.at[ids].add(jnp.tanh(x[ids]))
    raise AssertionError(kind)


def train_step(case):
    """`(params, batch) -> (params - 0.1 * grads, loss, last value)` of the case's recipe."""
    recipe = case["recipe"]

    def forward(params, batch):
        vals = [params[f"w{i}"] for i in range(case["params"])] + [batch["x"], batch["ids"]]
        for op in recipe:
            vals.append(_run_op(op, vals))
        new = vals[len(case["inputs"]):]
        loss = sum(jnp.mean(jnp.sin(v)) if v.dtype == jnp.float32 else jnp.mean(v.astype(jnp.float32)) * 1e-3
                   for v in new)
        return loss, new[-1]

    def step(params, batch):
        (loss, last), grads = jax.value_and_grad(forward, has_aux=True)(params, batch)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss, last

    return step


def arguments(case):
    """The case's input values, from its seed."""
    keys = iter(jax.random.split(jax.random.PRNGKey(case["seed"]), len(case["inputs"])))
    vals = [jax.random.normal(next(keys), s) / 2 if d == F32 else jax.random.randint(next(keys), s, 0, 4)
            for s, d in case["inputs"]]
    n = case["params"]
    return {f"w{i}": vals[i] for i in range(n)}, {"x": vals[n], "ids": vals[n + 1]}


def _tactics(case) -> list:
    plan, names = case["plan"], input_names(case)
    makers = {"dp": T.DataParallel, "megatron": T.Megatron, "fsdp": T.FSDP, "sp": T.SequenceParallel,
              "zero1": lambda a: T.ZeRO(a, 1), "zero2": lambda a: T.ZeRO(a, 2)}
    out = [T.Replicate(names[i]) if word == "replicate" else makers[word](axis)
           for word, axis, i in plan.get("tactics", [])]
    if plan.get("search"):
        out.append(search.AutomaticPartition(max_episodes=plan["episodes"], seed=plan["search_seed"],
                                             budget_s=600, device="cpu"))
    return out


def partition(case, program):
    """The case's plan applied to `program`: `(partitioning, actions applied, refused)`.
    A tactic that cannot apply is skipped, and must leave the partitioning as it was."""
    mesh = MeshSpec(tuple((a, n) for a, n in case["mesh"]))
    part = partir.Partitioning(program, mesh)
    plan, applied, refused = case["plan"], 0, 0
    tiles = [plan["first"]] + plan["tiles"]
    for i, dim, axis in tiles:
        v = program.inputs[program.input_names.index(_lifted_name(input_names(case)[i]))]
        try:
            part.tile(v, dim % program.values[v].rank, axis)
            applied += 1
        except PartitioningError:
            refused += 1  # indivisible, or the axis is taken: nothing changed
    schedule = _tactics(case)
    if schedule:
        res = T.apply_schedule(program, mesh, schedule, best_effort=True, start=part)
        before = part.key()
        for step in res.history:
            if step.skipped:
                assert step.partitioning.key() == before, f"{step.tactic} was skipped but changed the partitioning"
                refused += 1
            else:
                applied += 1
            before = step.partitioning.key()
        part = res.partitioning
    return part, applied, refused


def _lifted_name(glob: str) -> str:
    group, key = glob.split("/")
    return f"{group}['{key}']"


def uses_bf16(case) -> bool:
    """Whether the case computes in bfloat16 (its oracle then allows bf16's rounding)."""
    # A round trip through bf16 rounds alike on both sides; arithmetic in bf16 may not
    # (XLA may keep float32 where a fusion allows), so those cases allow bf16's rounding.
    return any((op[0] == "dot" and op[7]) or (op[0] == "unary" and op[3] == "bf16_tanh") for op in case["recipe"])


class Unsupported(Exception):
    """A case plain `jax.jit` cannot run here (no oracle): XLA:CPU lacks some kernels,
    e.g. a batched bfloat16 dot with a float32 result."""


def check_case(case) -> tuple[int, int]:
    """Partition the case's program as its plan says and check it against `jax.jit`;
    `(actions applied, actions refused)`. `Unsupported` when `jax.jit` cannot run it."""
    step, args = train_step(case), arguments(case)
    try:
        jax.block_until_ready(jax.jit(step)(*args))
    except jax.errors.JaxRuntimeError as e:
        # XLA says so only in words: an UNIMPLEMENTED status from the runtime.
        if "UNIMPLEMENTED" not in str(e):
            raise
        raise Unsupported(str(e).splitlines()[0]) from None
    program = partir.lift(step, *args)
    part, applied, refused = partition(case, program)
    tol = 3e-2 if uses_bf16(case) else 1e-4
    for backend in lowerings(case):
        partir.check_equivalence(step, args, part, rtol=tol, atol=tol / 10, backend=backend)
    return applied, refused


def lowerings(case) -> tuple[str, ...]:
    """The lowerings `check_case` checks the case under: both, but not `shard_map` where
    the recipe updates a slice of a value with values read from it (`dupdate`). XLA:CPU
    miscompiles that in-place `dynamic_update_slice` when the value reaches it through a
    bitcast, as the shard_map lowering's gathers make it: it reads positions it has
    already written (JAX 0.10.2 and 0.12; plain `jax.jit` too, after a reshape)."""
    return ("jit",) if any(op[0] == "dupdate" for op in case["recipe"]) else ("jit", "shard_map")


def describe(case) -> dict:
    """What a case covers, for the fuzz run's summary: op kinds, mesh rank, plan kind."""
    return {"ops": sorted({op[0] for op in case["recipe"]}), "mesh_axes": len(case["mesh"]),
            "plan": case["plan"]["kind"], "bf16": uses_bf16(case), "lowerings": list(lowerings(case))}
