"""Rematerialization: which forward values the backward pass reads again (the
*residuals*) are kept, and which are recomputed from kept ones.

A train step's forward pass leaves residuals for its backward pass: everything JAX's
differentiation decided the backward reads. Keeping them all is the memory peak of a
large model. Rematerializing a residual means not keeping it: the backward pass runs
again the forward ops that made it, from values that are kept (the *sources*), just
before it reads it. This module finds the program's *layers* (one per layer: the
forward ops of a layer, its inputs from outside, its residuals), says which residuals a
*policy* recomputes, and derives what recomputing a set of residuals takes:

    none         keep every residual
    full         keep nothing but the layer's inputs (the layer's input activation and
                 its parameters): the whole layer runs again
    dots         keep also the outputs of the matmuls with no batch dims (projections,
                 MLP), as `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`:
                 those the backward reads, and those a recomputation reads (a query
                 projection the rotary embedding rotates), never running one again
    collectives  keep also every value an op makes after moving data between devices
                 (a reduced partial sum, a result computed from a gathered operand), so
                 that recomputing never repeats communication
    dots_except_mlp_in
                 keep the outputs of every projection but the MLP's up and gate ones
                 (`partir._dot_roles`), as MaxText's `save_dot_except_mlpwi`: what
                 is recomputed is remade from them, those two matmuls run again
    dots_except_mlp
                 keep the attention's projections' outputs (query, key, value and
                 output), as MaxText's `save_dot_except_mlp`: the MLP runs again
    dots_with_context
                 keep what `dots` keeps and the attention's output (the `p v` core), as
                 MaxText's `minimal_with_context` (once `minimal_flash`) saves every
                 projection and the flash kernel's output: only elementwise work and
                 norms run again, and a fused attention kernel none
    every_other_dot
                 keep the outputs of the layer's first, third, fifth... projection in
                 program order and the attention's output (the `p v` core), as
                 torchtitan's selective op checkpointing saves every matmul but every
                 second one of a block and the attention kernel's outputs: the
                 second, fourth... projections run again
    qkv          keep only the attention's query, key and value projections' outputs,
                 as MaxText's `save_qkv_proj`: the rest of the layer runs again

The last four keep what they name whether or not the backward pass reads it: a
recomputation reads such an output instead of running its matmul again
(`Partitioning.save`, which the `Remat` tactic records).

Layers are found from the program's structure, never from names: a scan in the forward
pass is one layer per iteration (its body), and the layers of an unrolled program are
those of its inputs (`partir._layers`): an op belongs to the last layer whose
parameters it depends on.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._dot_roles import attention_outputs, dot_roles
from ._errors import PartitioningError
from ._layers import input_layers, weight_derived
from ._graph import call_roots
from ._nested import Link

#: Ops that only reshape or cast what they read (a matmul's output seen through them is
#: still a matmul's output). `jax.checkpoint` marks each value its policy saves with a
#: `reduce_precision` to the value's own precision.
SEEN_THROUGH = ("reshape", "convert_element_type", "transpose", "squeeze", "expand_dims", "copy", "copy_p",
         "reduce_precision", "name")

#: Rematerialization policies, from keeping everything to keeping the least.
POLICIES = ("none", "collectives", "dots_with_context", "dots", "dots_except_mlp_in", "dots_except_mlp",
            "every_other_dot", "qkv", "full")

#: The policies that keep the outputs of some roles of projections (`partir._dot_roles`).
KEPT_ROLES = {"dots_except_mlp_in": ("qkv", "attention_out", "mlp_out", "other"),
              "dots_except_mlp": ("qkv", "attention_out"), "qkv": ("qkv",)}
#: The policies that keep some matmuls' outputs whether or not the backward pass reads
#: them (`saved_dots`).
SAVING = (*KEPT_ROLES, "dots_with_context", "every_other_dot")
#: The policies that keep every plain matmul's output the backward pass reads, as
#: `jax.checkpoint_policies.dots_with_no_batch_dims_saveable` does.
KEEPING_DOTS = ("dots", "collectives", "dots_with_context")


@dataclass(frozen=True)
class Layer:
    """One layer's forward pass: `ops` (op ids, in program order), `inputs` (values it
    reads from outside: the layer's input activation, its parameters), `residuals`
    (values it makes that the backward pass reads) and `label` (for people). `loop` is
    the scan body region when the layer is one, else -1."""

    index: int
    label: str
    ops: tuple[int, ...]
    inputs: frozenset
    residuals: tuple[int, ...]
    loop: int = -1


def check_policy(policy: str) -> None:
    """A clear error for an unknown policy name."""
    if policy not in POLICIES:
        raise PartitioningError(f"unknown rematerialization policy {policy!r}; choose one of {', '.join(POLICIES)}")


def residual_layers(program) -> tuple[Layer, ...]:
    """The program's layers with residuals (cached with it): forward scan bodies, else
    its layers."""
    return tuple(b for b in layers_of(program) if b.residuals)


def layers_of(program) -> tuple[Layer, ...]:
    """Every layer, those without residuals too (a layer whose `jax.checkpoint` keeps
    only its input): their inputs are layer boundaries all the same."""
    return program.analysis(_find_layers)


def _find_layers(program) -> tuple[Layer, ...]:
    backward = program.backward
    late = _read_late(program, backward)
    found = []
    for r in program.regions:
        if r.kind == "scan" and _forward_call(program, r, backward):
            found.append(_scan_layer(program, r, late, len(found)))
    if not found:
        found = _unrolled_layers(program, backward, late)
    return tuple(found)


def _forward_call(program, region, backward) -> bool:
    parent = program.regions[region.parent]
    eqn = next(parent.jaxpr.eqns[i] for i, c in parent.children.items() if region.id in c)
    return not any(backward[o.id] for o in program.ops if o.region == region.id) and \
        "transpose(" not in str(getattr(eqn.source_info, "name_stack", ""))


def _read_late(program, backward) -> list[bool]:
    """Per value: does a backward op read it (through links)?"""
    late = [False] * len(program.values)
    for op in reversed(program.ops):
        reads = any(late[r] for r in op.results if r >= 0) if op.link else backward[op.id]
        if reads:
            for v in op.operands:
                if v >= 0:
                    late[v] = True
    return late


def _scan_layer(program, region, late, index) -> Layer:
    ops, made = _region_ops(program, region.id)
    residuals = []
    for op in program.ops:
        if op.link and op.primitive == Link.SCAN_YS and op.operands[0] in made and late[op.results[0]]:
            residuals.append(op.operands[0])
    inputs = frozenset(region.invars) | frozenset(region.constvars)
    return Layer(index, f"scan#{region.id} body", tuple(ops), inputs, tuple(dict.fromkeys(residuals)), region.id)


def _region_ops(program, rid: int):
    """Non-link ops of region `rid` and the call regions inside it, and the values they make."""
    inside = {rid}
    for r in program.regions:
        if r.parent in inside and r.trip_count == 1:
            inside.add(r.id)
    calls = (Link.CALL_IN, Link.CALL_OUT)  # a call's boundary inside the body renames only
    ops = [op.id for op in program.ops if op.region in inside and (not op.link or op.primitive in calls)
           and not (op.link and op.region == rid and op.primitive not in calls)]
    made = {v for o in ops for v in program.ops[o].results if v >= 0}
    return ops, made


def _unrolled_layers(program, backward, late) -> list[Layer]:
    """Layers of an unrolled program's layers (no layers: no layers). Layer i runs from
    its input activation x_i to x_(i+1): x_i is made by the op that dominates (in the
    forward pass's dataflow) every op reading layer i's parameters, last among those
    that depend on layer i - 1 (the residual stream's add, say), as a scan's body runs
    from its carry in to its carry out."""
    taint, first = _taints(program, backward)
    layers = sorted(first)
    if not layers:
        return []
    derived = weight_derived(program, backward)
    idom = _dominators(program, backward, derived)
    last = _last_weight_reads(program, backward, taint, derived)
    spine = {}
    for i in layers[1:]:
        s, node = None, first[i]
        while node in idom and idom[node] != node and node >= 0:
            node = idom[node]
            if taint.get(node, -1) == i - 1 and node > last.get(i - 1, -1):
                s = node  # after every read of layer i - 1's weights: its output
            elif taint.get(node, -1) < i - 1 or node <= last.get(i - 1, -1):
                break
        if s is not None:
            spine[s] = i
    if len(layers) < 2 or len(spine) != len(layers) - 1:  # a layer not found (reading an input only)
        return []
    # Alike layers run alike ops in program order: layer i is what runs after x_i up to
    # x_(i+1), and the first and last layers are as long as the others.
    cuts = sorted(spine)
    # With two layers there is one cut: the period is the distance between the ops where
    # each layer's parameters first meet the activation (the same op of each layer).
    period = cuts[1] - cuts[0] if len(cuts) > 1 else first[layers[1]] - first[layers[0]]
    bounds = [cuts[0] - period] + cuts + [cuts[-1] + period]
    out = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        ops = list(range(lo + 1, hi + 1))  # calls' links included: a call's result is made where its body makes it
        made = {v for o in ops for v in program.ops[o].results if v >= 0}
        inputs = {u for o in ops for u in program.ops[o].operands if u >= 0 and u not in made}
        residuals = tuple(v for v in sorted(made) if late[v])
        out.append(Layer(i, f"layer {layers[i]}", tuple(ops), frozenset(inputs), residuals))
    return out


def _taints(program, backward):
    """Per forward non-link op, the last layer whose parameters it depends on (-1: none);
    and per layer, the first op combining its parameters with an earlier activation."""
    layer = [-1] * len(program.values)
    first: dict[int, int] = {}
    for v, i in input_layers(program).items():
        layer[v] = i
    taint = {}
    end = next((o for o, b in enumerate(backward) if b), len(program.ops))  # the forward pass ends
    for op in program.ops[:end]:
        if op.link:
            for r in op.results:
                if r >= 0 and op.operands[0] >= 0:
                    layer[r] = max(layer[r], layer[op.operands[0]])
            continue
        i = max((layer[u] for u in op.operands if u >= 0), default=-1)
        taint[op.id] = i
        reads_earlier = any(u >= 0 and layer[u] < i and not _from_input(program, u) for u in op.operands)
        if i >= 0 and reads_earlier:  # where layer i's parameters meet an earlier activation
            first.setdefault(i, op.id)
        for r in op.results:
            if r >= 0:
                layer[r] = i
    return taint, first


def _from_input(program, u: int) -> bool:
    """Is `u` an input, seen through call boundaries?"""
    for _ in range(64):
        if u < 0:
            return False
        p = program.producer[u]
        if p < 0:
            return True
        op = program.ops[p]
        if not (op.link and op.primitive == Link.CALL_IN):
            return False
        u = op.operands[0]
    return False


def _last_weight_reads(program, backward, taint, derived) -> dict:
    """Per layer, the last forward op that reads its weights (made from its parameters
    alone) together with an activation."""
    last: dict[int, int] = {}
    for op in program.ops:
        if op.id in taint and any(u >= 0 and derived[u] for u in op.operands) and \
                any(u >= 0 and not derived[u] for u in op.operands):
            last[taint[op.id]] = op.id
    return last


def _dominators(program, backward, derived) -> dict:
    """Immediate dominators of the forward ops in the dataflow of activations: what is
    made from layer parameters alone is left out, and the other inputs feed their
    readers from the start (-1, not in the result). An op reads only values made before
    it, so the graph is acyclic with the ops in program order, and one pass in that
    order finds each op's immediate dominator as the meeting point of its readers'
    (Cooper, Harvey and Kennedy's walk): on an unrolled 70B step, a general graph
    library's took seconds."""
    idom = {-1: -1}
    for op in program.ops:
        if backward[op.id] or (op.results and all(r < 0 or derived[r] for r in op.results)):
            continue
        made = [program.producer[u] for u in op.operands if u >= 0 and not derived[u] and program.producer[u] >= 0]
        preds = [p for p in made if p in idom] or [-1]
        d = preds[0]
        for p in preds[1:]:
            while d != p:  # up the dominator tree from the later of the two until they meet
                if d > p:
                    d = idom[d]
                else:
                    p = idom[p]
        idom[op.id] = d
    del idom[-1]
    return idom


def recomputed(program, layer: Layer, policy: str, part=None) -> tuple[int, ...]:
    """The residuals of `layer` that `policy` does not keep. Values other layers read
    (the next layer's input) are always kept; `collectives` needs the partitioning, to
    know which ops move data."""
    check_policy(policy)
    if policy == "none":
        return ()
    root = call_roots(program)
    boundary = {root[v] for b in layers_of(program) for v in b.inputs}
    keep = {r for r in layer.residuals if root[r] in boundary}
    if policy in KEEPING_DOTS:
        keep |= {r for r in layer.residuals if _plain_dot(program, r)}
    if policy in SAVING:
        kept = {program.producer[v] for v in saved_dots(program, layer, policy)}  # the matmuls kept
        keep |= {r for r in layer.residuals if _dot_of(program, r) in kept}
    if policy == "collectives":
        if part is None:
            raise PartitioningError("the 'collectives' policy needs the partitioning (which ops move data)")
        keep |= {r for r in layer.residuals if _communicates(part, program.producer[r])}
    return tuple(r for r in layer.residuals if r not in keep)


def saved_dots(program, layer: Layer, policy: str) -> tuple[int, ...]:
    """The outputs of the matmuls of `layer` that `policy` keeps (`SAVING`: its
    projections of the roles `KEPT_ROLES` names, or every other one and the attention's
    output, or the attention's output beside what `dots` keeps; none for the other
    policies), made where the layer's residuals are (a scan's
    body): one made in a call nested there is remade with its call."""
    check_policy(policy)
    roles = dot_roles(program, layer)
    if policy not in SAVING or not roles:
        return ()
    # A layer a user's checkpoint recomputes may have no residuals: its matmuls say where.
    made = layer.residuals or [program.ops[o].results[0] for o in sorted(roles)]
    home = layer.loop if layer.loop >= 0 else program.values[made[0]].region
    if policy == "every_other_dot":
        ops = sorted(sorted(roles)[::2] + list(attention_outputs(program, layer)))
    elif policy == "dots_with_context":
        ops = list(attention_outputs(program, layer))
    else:
        ops = [o for o, role in sorted(roles.items()) if role in KEPT_ROLES[policy]]
    return tuple(v for o in ops for v in program.ops[o].results if v >= 0 and program.values[v].region == home)


def layer_values(program) -> frozenset:
    """The values the layers' forward ops make (what `Partitioning.save` may keep)."""
    return program.analysis(_layer_values)


def _layer_values(program) -> frozenset:
    return frozenset(v for b in layers_of(program) for o in b.ops if not program.ops[o].link
                     for v in program.ops[o].results if v >= 0)


def _plain_dot(program, v: int) -> bool:
    """Is `v` made by a matmul with no batch dims (a projection, an MLP matmul), maybe
    reshaped or cast after it?"""
    p = _dot_of(program, v)
    return p >= 0 and _is_plain_dot_op(program, p)


def _dot_of(program, v: int) -> int:
    """The op that makes `v`, seen through reshapes and casts (-1: an input)."""
    p = program.producer[v]
    while p >= 0 and program.ops[p].primitive in SEEN_THROUGH and program.ops[p].operands[0] >= 0:
        p = program.producer[program.ops[p].operands[0]]
    return p


def _communicates(part, op: int) -> bool:
    return op >= 0 and not part.classes.trivial[op] and bool(part.reshards([op]))


@dataclass(frozen=True)
class Recompute:
    """What recomputing a set of residuals takes: per residual, the kept values it is
    recomputed from (`sources`); the forward ops run again (`ops`, in program order);
    and per layer index, its recomputed residuals (`by_layer`)."""

    sources: dict
    ops: tuple[int, ...]
    by_layer: dict


def recompute(program, residuals: frozenset, saved: frozenset = frozenset()) -> Recompute:
    """The recomputation of `residuals` (each a residual of some layer), reading the
    values `saved` (`Partitioning.saved`) instead of remaking them; kept with the
    program per pair of sets (`Program.analysis`): a search, the cost model and the
    lowering ask again and again for the few sets the remat policies make."""
    return program.analysis(_recompute, frozenset(residuals), frozenset(saved))


def _recompute(program, residuals: frozenset, saved: frozenset) -> Recompute:
    where = {r: b for b in residual_layers(program) for r in b.residuals}
    root = call_roots(program)
    kept = {root[v]: v for b in layers_of(program) for v in sorted(b.inputs)}  # every layer's input is kept
    sources, ops, by_layer, in_layer, saveable = {}, set(), {}, {}, {}
    for r in sorted(residuals):
        b = where.get(r)
        if b is None:
            raise PartitioningError(f"{program.name(r)} is not a residual of any layer: nothing to recompute")
        by_layer.setdefault(b.index, []).append(r)
        if b.index not in in_layer:  # a layer's op set, once for all its residuals
            in_layer[b.index] = frozenset(b.ops)
            saveable[b.index] = _saveable_dots(program, b, residuals) | saved
        sources[r] = tuple(sorted(_walk(program, b, in_layer[b.index], r, residuals, ops, kept, root,
                                        saveable[b.index])))
    return Recompute(sources, tuple(sorted(ops)), {k: tuple(v) for k, v in by_layer.items()})


def _saveable_dots(program, layer: Layer, gone: frozenset) -> frozenset:
    """The values of `layer` a recomputation reads instead of remaking, beside the kept
    residuals and inputs: where the layer keeps its matmuls' outputs (it has residuals
    made by matmuls with no batch dims and recomputes none of them: `dots`,
    `collectives`), every output of such a matmul, as
    `jax.checkpoint_policies.dots_with_no_batch_dims_saveable` saves one the
    recomputation reads (a projection feeding the rotary embedding, say) rather than
    running the matmul again. Else none (`full`)."""
    dots = [r for r in layer.residuals if _plain_dot(program, r)]
    if not dots or any(r in gone for r in dots):
        return frozenset()
    # Only in the region the layer's residuals are made in (a scan's body): one made in a
    # call nested there is remade with its call, as before.
    home = layer.loop if layer.loop >= 0 else program.values[dots[0]].region
    return frozenset(v for o in layer.ops for v in program.ops[o].results
                     if v >= 0 and program.values[v].region == home and _is_plain_dot_op(program, o))


def _is_plain_dot_op(program, o: int) -> bool:
    op = program.ops[o]
    if op.primitive != "dot_general":
        return False
    (_, _), (lb, _) = op.eqn.params["dimension_numbers"]
    return not lb


def _walk(program, layer: Layer, in_layer: frozenset, r: int, gone: frozenset, ops: set, kept: dict,
          root, saveable: frozenset = frozenset()) -> set[int]:
    """The kept values `r` is recomputed from (made outside the layer, another layer's
    input, a residual kept, or a matmul's output the policy saves: `saveable`), adding
    the ops that remake it (`in_layer`: the layer's ops) to `ops`."""
    found, stack, seen = set(), [r], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        p = program.producer[v]
        if v != r and root[v] in kept and v not in layer.residuals:
            found.add(kept[root[v]] if kept[root[v]] in layer.inputs else v)  # the input, not a call's copy
            continue
        if p < 0 or p not in in_layer or (v != r and v in layer.residuals and v not in gone) or \
                (v != r and v in saveable):
            found.add(v)
            continue
        ops.add(p)
        stack += [u for u in program.ops[p].operands if u >= 0]
    return found
