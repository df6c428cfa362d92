"""Blockwise attention across a layer scan pair: the forward in the forward scan's body,
the backward in the backward scan's (`partir.layer_scans`).

Without `jax.checkpoint`, the forward scan of a differentiated step stacks what the
attention's backward reads as per-layer residuals (`Link.SCAN_YS`): the queries, keys
and values as the dots read them, and score-shaped values of the softmax (its
exponentials, its weights, the row sums). The backward scan slices each stack
(`Link.SCAN_XS`) and its body holds the four backward dots. `across_scans` links the
two sides through those stacks (a stack's slice is the residual the forward body
stacked) and matches the backward body as `OnlineAttention` matches one region: the
dots read the slices of the queries', keys' and values' stacks and of the weights'.

The blockwise attention then keeps none of the score-shaped residuals: the forward
body stacks its output and row log-sum-exp in the slot of one of them (`saved`) and a
scalar per layer in the others' (`dropped`); the backward body recomputes each key
block's weights from the queries, the block and the log-sum-exp. The stacks hold
blocks as each device made them: they cross the loops' boundaries unmoved.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._attention import attentions, kernel_region
from ._nested import Link
from ._online import OnlineAttention, Unmatched, _component, _matched, _need, _NoMatch, backward_dots
from ._scans import layer_scans


def online_attentions(program) -> tuple:
    """Per attention of `program` (`partir.attentions`), an `OnlineAttention`, an
    `OnlineForward` (no backward dots of its own), an `OnlineAcrossScans` (its backward
    in the paired backward layer scan), or an `Unmatched` saying why not (`partir._online`'s
    docstring). Kept with the program."""
    return program.analysis(_online_attentions)


def _online_attentions(program) -> tuple:
    region = kernel_region(program)
    return tuple(_match(program, region, a) for a in attentions(program))


def _match(program, region, a):
    try:
        return _matched(program, region, a, across_scans)
    except _NoMatch as e:
        return Unmatched(a.score, str(e))


@dataclass(frozen=True)
class OnlineAcrossScans(OnlineAttention):
    """An attention whose forward runs in a forward layer scan's body and whose backward
    runs in the paired backward scan's body (module docstring): `OnlineAttention`'s
    fields (`ops`: both bodies' ops of it, its residual stacks' links included), and `slices`:
    the backward body's slices of the queries', keys' and values' stacks; `saved`: (the
    forward body's residual whose stack slot carries the output and log-sum-exp, its
    stack, the backward body's slice of it); `dropped`: the same for each other
    score-shaped residual (stacked as a scalar per layer)."""

    slices: tuple[int, int, int]
    saved: tuple[int, int, int]
    dropped: tuple[tuple[int, int, int], ...]

    @property
    def backward_operands(self) -> tuple[int, int, int]:
        """The queries, keys and values as the backward dots read them: `slices`."""
        return self.slices


def across_scans(program, region, dims, head: tuple, stacked: list[int], forward_ops) -> OnlineAcrossScans:
    """The attention `head` (`OnlineForward`'s fields before `ops`) whose forward ops
    `forward_ops` stack residuals by the `Link.SCAN_YS` ops `stacked`, matched across
    its scan pair; _NoMatch saying why not."""
    a, p = head[0], head[7]  # the weights as the dots read them (cast or not)
    body = program.ops[a.score].region
    pair = next((s for s in layer_scans(program) if s.forward.body == body and s.backward is not None), None)
    _need(pair is not None, "it keeps residuals in a loop's stack for no backward layer scan")
    slices = {}  # forward body value -> the backward body's slice of its stack
    links = set(stacked)
    for o in stacked:
        inner, outer = program.ops[o].operands[0], program.ops[o].results[0]
        _need(program.values[inner].region == body, "its residuals are stacked from a call inside the layer")
        slices[inner] = _slice(program, pair.backward.body, outer, links)
    operands = []
    for v in (a.query, a.key, a.value):
        ys = [o for o in program.users[v] if program.ops[o].primitive == Link.SCAN_YS]
        _need(len(ys) == 1, "the backward scan reads its queries, keys or values from no stack of their own")
        # Their stacks stay (the blockwise backward reads them): their links are not the attention's.
        operands.append(_slice(program, pair.backward.body, program.ops[ys[0]].results[0], set()))
    _need(p in slices, "the forward scan stacks no weights for the backward scan")
    grads = backward_dots(program, region, dims, a.scores, tuple(operands), slices[p])
    seeds = (*slices.values(), program.ops[grads[0]].results[0])
    backward_ops = _component(program, region, seeds, grads[:4])
    stacks = sorted((program.ops[o].operands[0], program.ops[o].results[0], slices[program.ops[o].operands[0]])
                    for o in stacked)
    ops = frozenset(forward_ops) | backward_ops | links
    return OnlineAcrossScans(*head, ops, *grads, tuple(operands), stacks[0], tuple(stacks[1:]))


def _slice(program, body: int, stack: int, links: set) -> int:
    """The backward scan body's slice of `stack` (its one reader, a `Link.SCAN_XS`
    into `body`), its link added to `links`; _NoMatch otherwise."""
    readers = program.users[stack]
    _need(len(readers) == 1 and program.ops[readers[0]].primitive == Link.SCAN_XS
          and program.values[program.ops[readers[0]].results[0]].region == body,
          "a residual it stacks is read other than by the backward layer scan's body")
    links.add(readers[0])
    return program.ops[readers[0]].results[0]
