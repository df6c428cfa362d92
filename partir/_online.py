"""Attention a ring can run with an online softmax, found from the dataflow.

A ring plan (`Partitioning.ring`) moves each attention's keys and values round the
context axis one block at a time, but the program's own softmax reads a query block's
whole row of scores. The shard_map lowering can instead run the attention blockwise
(`partir.lowering._online`): per key block, the scores, the program's own elementwise
ops on them (scaling, a mask), and a running max and sum per query row that rescale the
output accumulator (flash attention's online softmax); the backward pass recomputes
each block's weights from the queries, the key block and the saved row log-sum-exp.
It can do so only where the program computes exactly that, which `online_attentions`
checks op by op:

- the *chain*: from the score dot's result, a line of ops each reading one value of
  the line and otherwise literals or values made from scalars (an iota mask, a fill,
  a scale), of the same shape or a transpose (`CHAIN_PRIMITIVES`), through calls'
  boundaries, to the softmax's input `x`;
- the *softmax*: `exp(x - c)` for a `c` constant along the keys' dim (the row max
  `jax.nn.softmax` subtracts, or any other shift: none changes the weights), divided
  by its sum over that dim, whose result the combine dot (`P V`) reads;
- the *backward*: the dots the differentiated program holds, `dO V^T` (reading the
  values), `P^T dO` (reading the weights and the same `dO`), and `dS K`, `dS^T Q`
  (reading one value `dS` of the scores' shape and dims: the scores' cotangent);
- nothing outside those dots reads a value of the attention's region, and none of
  its values leaves through a loop's boundary (a scan's stacked residual).

An attention whose forward pass no backward dot reads, and which keeps nothing for a
backward pass (the forward of a layer a user's `jax.checkpoint` recomputes in the
backward loop, or an inference step), is matched forward only (`OnlineForward`): the
chain, the softmax and the combine dot, run blockwise keeping only the output. The
rerun of such a layer in the backward pass, with the backward dots in one body, is an
`OnlineAttention` there.

A forward pass that stacks residuals for a backward layer scan is matched across the
scan pair (`partir._online_scans`). Anything else (dropout on the weights, a softmax
written another way, the weights returned, a value of the region carried round a
loop) keeps the program's softmax: the reason is recorded (`Unmatched`) and the tactic
lists it in its notes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._attention import forward_like, _region_dims
from ._graph import made_from_scalars
from ._nested import Link

#: Link ops a blockwise attention's region may cross: a call's boundary only renames a
#: value; a loop's (a scan's stacked residual, a carry) keeps it past the region.
_CALL_LINKS = frozenset({Link.CALL_IN, Link.CALL_OUT})

#: Primitives the chain from the scores to the softmax may hold: elementwise ops a
#: block of the scores computes alone (with its block of any mask or scale), and a
#: transpose, which moves the block's dims as it moves the row's.
CHAIN_PRIMITIVES = frozenset({"mul", "div", "add", "sub", "neg", "select_n", "convert_element_type", "max", "min",
                              "transpose"})
#: Ops that bring the row sum back to the weights' shape before the division.
_BROADCASTS = frozenset({"broadcast_in_dim", "reshape"})


@dataclass(frozen=True)
class OnlineForward:
    """An attention's forward pass the ring can run with an online softmax (module
    docstring); alone, an attention with no backward pass of its own (a checkpointed
    layer's first pass, whose rerun holds the backward dots, or an inference step).

    `chain`: op ids from the score dot's result to the softmax input `x` (link ops
    included: identities); `chain_key_dims`: per chain op, the keys' dim of its result.
    `weights`: the softmax's result `P`, `row_sum` its row sums (before they are
    broadcast back), `key_dim` the keys' dim of `x` and `P`; `read`: `P` as the dots
    read it (`P`, or its cast to the dtype of a mixed-precision step's `P V`). `ops`: every op whose
    work the blockwise attention does instead (the region's ops, links included, and
    its dots)."""

    attention: object
    chain: tuple[int, ...]
    chain_key_dims: tuple[int, ...]
    x: int
    weights: int
    row_sum: int
    key_dim: int
    read: int
    ops: frozenset

    @property
    def backward_dots(self) -> tuple[int, ...]:
        """The dots of its backward pass: none."""
        return ()


@dataclass(frozen=True)
class OnlineAttention(OnlineForward):
    """An attention the ring can run with an online softmax, forward and backward
    (module docstring): `OnlineForward`'s fields, and `grad_scores`, `grad_values`,
    `grad_queries_dot`, `grad_keys_dot`: the backward dots `dO V^T`, `P^T dO`, `dS K`,
    `dS^T Q` (op ids); `grad_out` the value `dO`, `grad_logits` the value `dS`."""

    grad_scores: int
    grad_values: int
    grad_queries_dot: int
    grad_keys_dot: int
    grad_out: int
    grad_logits: int

    @property
    def backward_dots(self) -> tuple[int, ...]:
        """The four dots of the backward pass."""
        return (self.grad_scores, self.grad_values, self.grad_queries_dot, self.grad_keys_dot)

    @property
    def backward_operands(self) -> tuple[int, int, int]:
        """The queries, keys and values as the backward dots read them: the forward's."""
        a = self.attention
        return (a.query, a.key, a.value)


@dataclass(frozen=True)
class Unmatched:
    """An attention (score dot `score`) the ring runs with the program's softmax, and why."""

    score: int
    reason: str


class _NoMatch(Exception):
    pass


def _need(ok: bool, reason: str) -> None:
    if not ok:
        raise _NoMatch(reason)


def _matched(program, region, a, across):
    """The match of attention `a` (`partir.online_attentions`); `across`: the matcher of
    one whose forward stacks residuals for a backward layer scan (`_online_scans`)."""
    forward = forward_like(program)
    dims = _region_dims(program, region, a.scores)
    chain, keys, x, sub = _chain(program, dims, forward, a)
    key = keys[-1] if keys else a.score_key_dim
    p, row_sum = _softmax(program, forward, x, key, sub)
    read = _weights_read(program, forward, p, a.combine)
    head = (a, tuple(chain), tuple(keys), x, p, row_sum, key, read)
    if not [o for o in program.users[a.value] if region.score[o] and not forward[o]]:
        stacked = []  # no backward dot reads the values here: a forward pass alone, or one keeping residuals
        ops = _component(program, region, (a.scores,), (a.score, a.combine), stacked)
        if not stacked:
            return OnlineForward(*head, ops)
        return across(program, region, dims, head, stacked, ops)
    grads = backward_dots(program, region, dims, a.scores, (a.query, a.key, a.value), read)
    dots = (a.score, a.combine) + grads[:4]
    _need(len({program.ops[o].region for o in dots}) == 1, "its forward and backward dots run in different regions")
    ops = _component(program, region, (a.scores, program.ops[grads[0]].results[0]), dots)
    return OnlineAttention(*head, ops, *grads)


def backward_dots(program, region, dims, scores: int, operands: tuple[int, int, int], p: int) -> tuple[int, ...]:
    """`OnlineAttention`'s backward fields, in order (the four dots, `dO`, `dS`): the
    backward dots reading `operands` (the queries, keys and values as the backward pass
    reads them) and `p` (the weights as it reads them), their `dS` laid out as `scores`
    (`dims`: `_region_dims` of them), or _NoMatch."""
    forward = forward_like(program)
    query, key, value = operands

    def dot_users(v: int) -> list[int]:  # the backward dots of the region reading v
        return [o for o in program.users[v] if region.dots[o] and not forward[o]]

    def reading_region(v: int) -> list[int]:
        return [o for o in dot_users(v) if any(region.values[u] for u in program.ops[o].operands if u >= 0)]

    grad_scores = [o for o in dot_users(value) if region.score[o]]
    _need(len(grad_scores) == 1, "no single backward dot dO V^T reads the values")
    d_out = next(u for u in program.ops[grad_scores[0]].operands if u != value)
    grad_values = [o for o in dot_users(p) if d_out in program.ops[o].operands]
    _need(len(grad_values) == 1, "no single backward dot P^T dO reads the weights")
    key_dots, query_dots = reading_region(key), reading_region(query)
    _need(len(key_dots) == 1 and len(query_dots) == 1, "no single dS K and dS^T Q in the backward pass")
    ds = [u for u in program.ops[key_dots[0]].operands if u != key]
    _need(len(ds) == 1 and ds[0] in program.ops[query_dots[0]].operands, "dS K and dS^T Q read different dS")
    rank = program.values[scores].rank
    _need(program.values[ds[0]].shape == program.values[scores].shape
          and dims.get(ds[0]) == {d: d for d in range(rank)}, "dS is not laid out as the scores")
    return (grad_scores[0], grad_values[0], key_dots[0], query_dots[0], d_out, ds[0])


def _chain(program, dims, forward, a):
    """(op ids, keys' dim of each result, softmax input, its subtraction) from the
    scores along the chain: the chain ends at the value a row constant is subtracted
    from; ops reading chain values off it (the max, its gradient's masks) are the
    region's, replaced with it."""
    free = made_from_scalars(program)
    chain, keys, v = [], [], a.scores
    while True:
        key = keys[-1] if keys else a.score_key_dim
        users = [program.ops[o] for o in program.users[v] if forward[o]]
        subs = [op for op in users if op.primitive == "sub" and op.operands[0] == v
                and _row_constant(program, op.operands[1], key)]
        if subs:
            return chain, keys, v, subs[0]
        nxt = [op for op in users if op.primitive in CHAIN_PRIMITIVES | {Link.CALL_IN, Link.CALL_OUT}]
        _need(len(nxt) == 1, "no softmax: no x - max(x) along one line of ops from the scores")
        op = nxt[0]
        if not op.link:
            _need(op.operands.count(v) == 1 and len(op.results) == 1, f"{op.primitive} reads the scores twice")
            others = [u for u in op.operands if u != v]
            _need(all(u < 0 or free[u] for u in others), f"{op.primitive} on the scores reads more than constants")
            shape = program.values[op.results[0]].shape
            _need(all(u < 0 or program.values[u].shape in (shape, ()) for u in others),
                  f"{op.primitive} on the scores broadcasts an operand")
        r = op.results[0]
        key = [d for d, s in dims.get(r, {}).items() if s == a.score_key_dim]
        _need(len(key) == 1, f"{op.primitive} on the scores loses the keys' dim")
        chain.append(op.id)
        keys.append(key[0])
        v = r


def _row_constant(program, c: int, key: int) -> bool:
    """Is `c` the same along dim `key` (of size 1 there, or broadcast along it)? Any
    such shift leaves the softmax as it is (a shift of a row changes none of its
    weights): the blockwise attention shifts by its own running max."""
    if c < 0:
        return False
    if program.values[c].shape[key] == 1:
        return True
    op = program.ops[program.producer[c]] if program.producer[c] >= 0 else None
    return op is not None and op.primitive == "broadcast_in_dim" and key not in op.eqn.params["broadcast_dimensions"]


def _softmax(program, forward, x: int, key: int, sub) -> tuple[int, int]:
    """(the weights `exp(x - c) / sum(exp(x - c))` over `key` from the subtraction
    `sub`, the row sums), or _NoMatch."""
    e = _only(program, forward, sub.results[0], "exp")
    sums = [program.ops[o] for o in program.users[e] if forward[o] and program.ops[o].primitive == "reduce_sum"]
    _need(len(sums) == 1 and tuple(sums[0].eqn.params["axes"]) == (key,), "no softmax: no sum over the keys")
    total = sums[0].results[0]
    while True:
        nxt = [program.ops[o] for o in program.users[total] if forward[o] and program.ops[o].primitive in _BROADCASTS]
        if len(nxt) != 1:
            break
        total = nxt[0].results[0]
    divs = [program.ops[o] for o in program.users[e] if program.ops[o].primitive == "div"
            and program.ops[o].operands == (e, total)]
    _need(len(divs) == 1, "no softmax: exp is not divided by its sum")
    return divs[0].results[0], sums[0].results[0]


def _weights_read(program, forward, p: int, combine: int) -> int:
    """The weights `p` as the combine dot reads them: `p` itself, or its one cast (a
    bfloat16 step's `jax.nn.dot_product_attention` takes the softmax in float32 and
    casts the weights to the values' dtype for `P V`); _NoMatch otherwise."""
    if p in program.ops[combine].operands:
        return p
    casts = [program.ops[o] for o in program.users[p]
             if forward[o] and program.ops[o].primitive == "convert_element_type"]
    _need(len(casts) == 1 and casts[0].results[0] in program.ops[combine].operands,
          "the combine dot does not read the softmax's result")
    return casts[0].results[0]


def _only(program, forward, v: int, primitive: str) -> int:
    found = [program.ops[o] for o in program.users[v] if forward[o] and program.ops[o].primitive == primitive]
    _need(len(found) == 1, f"no softmax: no {primitive} of x - max(x)")
    return found[0].results[0]


def _component(program, region, seeds, dots, stacked: list | None = None) -> frozenset:
    """The ops of the attention's region reached from `seeds` (the scores and dO V^T's
    result), with `dots`; _NoMatch when anything else reads one of its values. With
    `stacked`, the scan's stacked outputs (`Link.SCAN_YS` ops) leaving the region are
    added to it instead (not followed) and are no reason."""
    seen, stack, ops = set(), list(seeds), set(dots)
    while stack:
        v = stack.pop()
        if v < 0 or v in seen:
            continue
        seen.add(v)
        for o in program.users[v]:
            if o in dots:
                continue
            op = program.ops[o]
            if stacked is not None and op.primitive == Link.SCAN_YS:
                stacked.append(o)
                continue
            _need(not op.link or op.primitive in _CALL_LINKS,
                  f"a value of it crosses a loop's boundary ({op.primitive}) other than as a layer scan's stacked "
                  "residual; blockwise attention keeps no such value")
            _need(region.ops[o] or op.link, f"{op.primitive} (op {o}) outside the attention reads its scores")
            ops.add(o)
            stack += [r for r in op.results if r >= 0]
    dot_results = {r for o in dots for r in program.ops[o].results}
    _need(not (seen - dot_results) & set(program.outputs), "the program returns a value of the attention's region")
    return frozenset(ops)


def online_reason(part, m, rings: dict) -> str | None:
    """Why plan `part` (its ring dots `rings`, `partir.ring_moves`) cannot run attention
    `m` (an `OnlineAttention`, `OnlineForward` or `OnlineAcrossScans`) blockwise, or None when it can: every
    one of its dots must move the keys and values (or their gradients) round one axis,
    in a plan without a Remat tactic or pipelines (a layer scan's body and a user's
    `jax.checkpoint` are fine: each body's match runs where the body runs)."""
    a = m.attention
    want = {a.score: "gather", a.combine: "gather"}
    if m.backward_dots:
        want.update({m.grad_scores: "gather", m.grad_queries_dot: "gather", m.grad_keys_dot: "scatter",
                     m.grad_values: "scatter"})
    if any(o not in rings or rings[o].kind != k for o, k in want.items()):
        return "not every dot of it moves its keys and values round a ring"
    if len({rings[o].axis for o in want}) != 1:
        return "its rings run over different axes"
    if part.rematerialized or part.reused or part.pipelines:
        return "the plan rematerializes (a Remat tactic) or pipelines it (blockwise attention keeps no residuals there)"
    slots, partial, _ = part.block_layout(a.combine)
    if partial:
        return "its combine dot leaves the output partial"
    if not m.backward_dots:
        return None
    prog = part.program
    query = m.backward_operands[0]
    d_out = [_layout(part, o, prog.ops[o].operands.index(m.grad_out)) for o in (m.grad_scores, m.grad_values)]
    queries = [_layout(part, a.score, prog.ops[a.score].operands.index(a.query)),
               _layout(part, m.grad_keys_dot, prog.ops[m.grad_keys_dot].operands.index(query))]
    out = next(d for side, _, _, d in slots if side == "result")
    if d_out[0] != d_out[1] or d_out[0] != out or queries[0] != queries[1]:
        return "its dots read the output's gradient or the queries in different layouts"
    return None


def _layout(part, o: int, k: int) -> tuple:
    """The dims of operand `k` as op `o` reads it."""
    return next(d for side, j, _, d in part.block_layout(o)[0] if side == "operand" and j == k)
