"""Megatron tensor parallelism, recognised from the dataflow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from typing import NamedTuple

from partir import Kind, PartitioningError, transition

from . import _checks as check
from ._base import Context, Tactic, TacticError
from ._groups import input_groups
from ._roles import roles, weight_dims

#: Ops that contract their operands: the matmuls and convolutions Megatron splits.
CONTRACTIONS = ("dot_general", "conv_general_dilated")

#: Why Megatron left a parameter whole over its axis (`LeftOut.why`).
WHY = {
    "no-contraction": "no matmul, convolution or gather reads it",
    "no-free-dim": "the matmuls that read it contract or batch every dim of it",
    "cannot-tile": "the dim cannot be split over the axis",
    "input-split": "the matmul's input would be split",
    "gather": "an activation would need an all-gather or all-to-all",
    "spreads": "the split reaches several weights on their contracting dims",
    "no-partial-sums": "no contraction turns the split into partial sums",
    "activation-contraction": "its partial sums come from a contraction of two computed activations",
    "cut": "the matmul's result is cut into pieces along the dim (a fused projection), or reshaped so that the "
           "pieces are a dim of their own",
    "positions": "a gather reads it at indices that no input of the step determines (positions): it is read whole",
}


@dataclass(frozen=True)
class Block:
    """One tensor-parallel block: the weight split on its output features (column
    parallel), the op that reads it, the forward ops where the block's partial sums are
    reduced (row parallel) and the parameters the split reached (`members`). A fused
    projection whose result is cut into pieces (`[q; k; v]` then `jnp.split`, or viewed
    as `[3, heads, head_dim]` first) stays whole: `pieces` are the activations split
    after the cut (the pieces, or the view), `op` the op that cuts."""

    weight: int
    dim: int
    op: int
    reductions: tuple[int, ...]
    members: tuple[int, ...] = ()
    pieces: tuple[int, ...] = ()


@dataclass(frozen=True)
class LeftOut:
    """A parameter Megatron left whole over its axis: the dim it tried (None when it
    tried none), why (a key of `WHY`) and the detail in the program's names."""

    weight: int
    dim: int | None
    why: str
    detail: str


class Use(NamedTuple):
    """A forward read of a parameter by a matmul, convolution or gather. `free` and
    `contracting` are in the weight's own dims; `dims[d]` is the weight dim that the
    op's operand dim `d` is."""

    weight: int
    op: int
    operand: int
    free: tuple[int, ...]
    contracting: tuple[int, ...]
    dims: tuple[int, ...]


def weight_uses(prog, params, forward_end) -> list[Use]:
    """Each forward read of a parameter by a matmul, convolution or gather, in op order.
    Free dims are a matmul operand's output features, a kernel's output features, a
    gather table's indexed (vocabulary) dim. The parameter may reach the op through
    casts, transposes and a scan's slicing of stacked layers."""
    out = []
    for op in prog.ops[:forward_end]:
        if op.link:
            continue
        picks = []
        if op.primitive == "dot_general":
            (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
            for k, (c, b) in enumerate(((lc, lb), (rc, rb))):
                free = [d for d in range(prog.values[op.operands[k]].rank) if d not in c and d not in b]
                picks.append((k, free, list(c)))
        elif op.primitive == "conv_general_dilated" and op.eqn.params.get("feature_group_count", 1) == 1:
            spec = op.eqn.params["dimension_numbers"].rhs_spec
            picks.append((1, [spec[0]], [spec[1]]))
        elif op.primitive == "gather":
            dn, sizes = op.eqn.params["dimension_numbers"], op.eqn.params["slice_sizes"]
            shape = prog.values[op.operands[0]].shape
            rows = [d for d in dn.start_index_map if sizes[d] == 1 and shape[d] > 1 and d not in dn.operand_batching_dims]
            picks.append((0, rows, []))
        for k, free, contracting in picks:
            root = weight_dims(prog, op.operands[k]) if op.operands[k] >= 0 else None
            if root is not None and root[0] in params:
                w, dims = root
                out.append(Use(w, op.id, k, tuple(dims[d] for d in free), tuple(dims[d] for d in contracting), dims))
    return out


@dataclass(frozen=True)
class Megatron(Tactic):
    """Megatron-LM tensor parallelism over `axis`, found from the dataflow graph.

    For each weight a forward matmul reads (in program order), it tries splitting the
    weight's output features over `axis` (each free dim in turn, for a kernel with
    several, such as `[embed, heads, head_dim]`) and keeps the first split with which
    propagation closes a tensor-parallel block: the matmul's input stays whole, no
    activation must be gathered over `axis`, and some contraction downstream (the
    row-parallel matmul, a softmax over a split vocabulary) turns the split into partial
    sums, other than a contraction of two computed activations (attention scores over a
    split head_dim: that would cut the attention in the middle; in the backward, the
    gradient of keys and values that split query heads share, summed over the heads
    and read next by the key/value projection, is no such cut). Weights the block
    reaches are split by propagation and not tried again. Where a matmul's result is cut
    into pieces along the split dim (a fused `[q; k; v]` projection and `jnp.split`), a
    split of the weight would cross the pieces' boundaries: the weight stays whole and
    the pieces are split after the cut; where it is viewed as `[3, heads, head_dim]`
    before the cut, each device's heads of q, k and v are no block of the fused dim:
    the weight stays whole and the view is split on its heads. A gather at indices that
    no input determines (position embeddings at `arange(seq)`) is no lookup: its table
    stays whole. Names play no part.

    Textbook pattern: MLP = column-parallel then row-parallel matmul, one all-reduce in
    the forward and one in the backward; attention = Q/K/V split by heads, output
    projection row-parallel, likewise; embedding and LM head split on the vocabulary
    (a partial lookup reduced once; softmax statistics reduced over `axis`).
    The blocks found are left in `ctx.blocks[axis]`, the parameters left whole and why
    in `ctx.left_out[axis]`.
    """

    splits_weights: ClassVar[bool] = True  # see Tactic.splits_weights

    axis: str

    def __post_init__(self):
        check.text("Megatron axis", self.axis, example="axis='model'", error=TacticError)

    def apply(self, part, ctx: Context):
        prog = part.program
        r = roles(prog)
        uses = weight_uses(prog, set(r.params), r.forward_end)
        finder = _BlockFinder(self, part, r, uses)
        for use in uses:
            finder.visit(use)
        if not finder.blocks:
            tried = [x for x in finder.trials if x.why != "no-contraction"]
            detail = "; ".join(f"{prog.name(x.weight)}: {x.detail}" for x in tried[:4]) or WHY["no-contraction"]
            raise TacticError(f"found no tensor-parallel block over {self.axis!r} "
                              f"(size {part.mesh.size(self.axis)}): {detail}")
        left_out = finder.left_out()
        ctx.blocks.setdefault(self.axis, []).extend(finder.blocks)
        ctx.left_out.setdefault(self.axis, []).extend(left_out)
        return part, finder.notes(left_out)


class _BlockFinder:
    """One pass of `Megatron` over a program's weight uses."""

    def __init__(self, tactic: Megatron, part, roles, uses):
        self.axis, self.source = tactic.axis, str(tactic)
        self.part, self.prog, self.roles, self.uses = part, part.program, roles, uses
        self.params = set(roles.params)
        # Layers built alike behave alike: a block found in one layer is taken for every
        # weight of its group (see `input_groups`) without trying each again.
        self.groups = input_groups(self.prog, roles.params)
        self.group_of = {v: g for g in self.groups for v in g.members}
        self.blocks: list[Block] = []
        self.trials: list[LeftOut] = []
        self.tried: set = set()

    def visit(self, use: Use) -> None:
        """Try the free dims of one weight use in order; keep the first block found. A
        gather at indices that no input determines is no lookup to split (positions)."""
        w, op = use.weight, self.prog.ops[use.op]
        if op.primitive == "gather" and not self.reaches(op.operands[1], self.roles.batch):
            self.trials.append(LeftOut(w, None, "positions", f"{_where(self.prog, op.id)} reads its rows at indices "
                                       "computed from no input of the step (positions, from an iota): the same rows "
                                       "every step, read whole as a table added directly is"))
            return
        for dim in use.free:
            if self.axis in self.part.tiling(w).axes():
                return  # split already, by a block found earlier
            if (w, dim) in self.tried:
                continue
            self.tried.add((w, dim))
            block = self._try_weight(use, dim)
            if block is None:
                block = self._try_cut(use, dim)
            if block is not None:
                self.blocks.append(block)
                if not block.pieces:
                    self._spread(block)
                return

    def _try_weight(self, use: Use, dim: int):
        part, w = self.part, use.weight
        mark = part.mark()
        try:
            part.tile(w, dim, self.axis, source=self.source)
        except PartitioningError as e:
            self.trials.append(LeftOut(w, dim, "cannot-tile", str(e)))
            return None
        op = self.prog.ops[use.op]
        act = op.operands[1 - use.operand] if op.primitive in CONTRACTIONS else op.operands[1]
        return self._check(mark, w, dim, op.id, act, ())

    def _try_cut(self, use: Use, dim: int):
        """Where the weight's split failed because the matmul's result is cut into pieces
        along that dim, split the pieces instead (the projection stays whole)."""
        cut = _cut(self.prog, self.prog.ops[use.op], use, dim)
        if cut is None:
            return None
        (cut_op, pieces, piece_dim, note), prog, part = cut, self.prog, self.part
        mark = part.mark()
        try:
            for v in pieces:
                if self.axis not in part.tiling(v).axes():
                    part.tile(v, piece_dim, self.axis, source=self.source)
        except PartitioningError as e:
            part.rollback(mark)
            self.trials.append(LeftOut(use.weight, dim, "cannot-tile", f"{note}, and the pieces cannot be split: {e}"))
            return None
        block = self._check(mark, use.weight, dim, cut_op, prog.ops[cut_op].operands[0], pieces)
        if block is not None:
            self.trials.append(LeftOut(use.weight, dim, "cut", f"{note}, so it stays whole and the pieces are split "
                                                               "after the cut"))
        return block

    def _check(self, mark, w, dim, op, act, pieces):
        """The block that the tiling since `mark` closes, or None (rolled back, with why)."""
        why = _closes(self, mark, act)
        if why is not None:
            self.part.rollback(mark)
            self.trials.append(LeftOut(w, dim, *why))
            return None
        return self._block(mark, w, dim, op, pieces)

    def _block(self, mark, w, dim, op, pieces):
        vals, ops = self.part.changed_since(mark)
        reductions = sorted({rs.op for rs in self.part.reshards(ops)
                             if self.axis in rs.src.partial and rs.op < self.roles.forward_end})
        members = tuple(sorted(v for v in vals if v in self.params and self.axis in self.part.tiling(v).axes()))
        return Block(w, dim, op, tuple(reductions), members, tuple(pieces))

    def _spread(self, block: Block) -> None:
        part = self.part
        for other in self.group_of[block.weight].members:
            self.tried.add((other, block.dim))
            if other == block.weight or self.axis in part.tiling(other).axes():
                continue
            mark = part.mark()
            try:
                part.tile(other, block.dim, self.axis, source=self.source)
            except PartitioningError as e:
                self.trials.append(LeftOut(other, block.dim, "cannot-tile", str(e)))
                continue
            self.blocks.append(self._block(mark, other, block.dim, -1, ()))

    def reaches(self, v: int, sources) -> bool:
        """Is `v` computed from some of `sources` (input values)?"""
        return v >= 0 and bool(self.prog.analysis(_reached, tuple(sources))[v])

    def left_out(self) -> list[LeftOut]:
        """Every parameter the axis does not split, with the reasons of its trials."""
        part, out = self.part, []
        read = {u.weight for u in self.uses}
        by_weight: dict = {}
        for x in self.trials:
            by_weight.setdefault(x.weight, []).append(x)
        for w in self.roles.params:
            if self.axis in part.tiling(w).axes():
                continue
            if w in by_weight:
                out += by_weight[w]
            else:
                why = "no-free-dim" if w in read else "no-contraction"
                out.append(LeftOut(w, None, why, WHY[why]))
        return out

    def notes(self, left_out) -> list[str]:
        """Readable notes: the blocks, the cut projections, the weights left out (a line
        per group of alike weights), the parameters no contraction reads."""
        prog = self.prog
        notes = [f"{len(self.blocks)} block(s) split over {self.axis!r}: "
                 + ", ".join(f"{prog.name(b.weight)}[dim {b.dim}]" + (" (after the cut)" if b.pieces else "")
                             for b in self.blocks)]
        why_of: dict = {}
        for x in left_out:
            why_of.setdefault(x.weight, []).append(x)
        unread = [prog.name(x.weight) for x in left_out if x.why == "no-contraction"]
        for g in self.groups:
            tried = [why_of[v] for v in g.members if v in why_of and why_of[v][0].why != "no-contraction"]
            if tried:
                # A cut says what happened instead; the failed split before it, why.
                shown = [x for x in tried[0] if x.why == "cut"] or tried[0]
                reasons = "; ".join(f"dim {x.dim}: {x.detail}" for x in shown)
                count = f" (x{len(tried)})" if len(tried) > 1 else ""
                notes.append(f"left whole over {self.axis!r}: {g.label}{count}: {reasons}")
        if unread:
            more = f", and {len(unread) - 6} more" if len(unread) > 6 else ""
            notes.append(f"{len(unread)} parameter(s) stay whole over {self.axis!r}, read by no matmul, convolution "
                         f"or gather (norm scales, biases of whole activations): {', '.join(unread[:6])}{more}")
        return notes


def _reached(prog, sources: tuple) -> bytearray:
    """Per value, whether it is computed from some of `sources` (input values): the
    program's alone, kept with it (every Megatron asks, on every axis)."""
    flags = bytearray(len(prog.values))
    for p in sources:
        flags[p] = 1
    for op in prog.ops:
        if any(u >= 0 and flags[u] for u in op.operands):
            for r in op.results:
                if r >= 0:
                    flags[r] = 1
    return flags


def _closes(finder: _BlockFinder, mark, act: int):
    """Why tiling since `mark` is not a tensor-parallel block (None if it is):
    `(why, detail)`. `act` is the input of the op that reads the split weight (or that
    cuts the fused projection into pieces)."""
    part, prog, axis = finder.part, finder.prog, finder.axis
    if act >= 0 and axis in part.tiling(act).axes():
        return "input-split", f"its input {prog.name(act)} would be split over {axis!r}"
    vals, ops = part.changed_since(mark)
    # A block ends in one row-parallel weight (or in reductions alone, as a softmax
    # over a split vocabulary does); a split that reaches several weights on their
    # contracting dims has escaped into the activations that all layers share.
    rows = {u.weight for u in finder.uses if u.weight in vals
            and any(axis in part.tiling(u.weight).dims[d] for d in u.contracting)}
    if len(rows) > 1:
        names = ", ".join(sorted(prog.name(w) for w in rows)[:3])
        return "spreads", f"the split spreads into the shared activations (row-split weights: {names})"
    forward_end = finder.roles.forward_end
    closed, gathers, sliced = False, [], set()
    for rs in part.reshards(ops):
        if axis in rs.src.partial:
            closed = True
            # In the backward, keys and values that split query heads read whole (multi-
            # query attention) get their gradient summed over the heads: partial sums
            # that a weight's matmul (the projection's backward) reads next, as it does a
            # column-parallel input's gradient. Any other is the attention cut in two.
            if _inner(finder, prog.ops[rs.op]) and (rs.op < forward_end or not _feeds_weight(finder, rs.value)):
                return "activation-contraction", (f"its partial sums come from {prog.name(rs.value)}, a contraction of "
                                                  "two computed activations (the split would cut the attention in the "
                                                  "middle)")
            continue
        if prog.rematerializable(rs.value):
            continue
        step = next((s for s in transition(rs.src, rs.dst, part.mesh)
                     if axis in s.axes and s.kind in (Kind.ALL_GATHER, Kind.ALL_TO_ALL)), None)
        if step is not None:
            gathers.append((rs, step))
        elif rs.op < forward_end and axis in rs.dst.axes() and axis not in rs.src.axes():
            sliced.add((prog.values[rs.value].shape, rs.src, rs.dst))
    # A whole value that the forward slices onto the axis (the pieces of a cut fused
    # projection, keys repeated for grouped queries) has its gradient gathered back in
    # the backward: that is the price of the slice. Any other gather means a leak.
    for rs, step in gathers:
        if rs.op < forward_end or (prog.values[rs.value].shape, rs.dst, rs.src) not in sliced:
            return "gather", f"{prog.name(rs.value)} would need an {step.kind} over {axis!r}"
    if not closed:
        return "no-partial-sums", "no contraction turns the split into partial sums (not a block)"
    return None


def _inner(finder: _BlockFinder, op) -> bool:
    """A contraction of two activations the model computes from its parameters (not of a
    weight, not of a one-hot of the labels): attention's scores or its weighted sum."""
    if op.primitive not in CONTRACTIONS:
        return False
    prog = finder.prog
    for v in op.operands:
        root = weight_dims(prog, v) if v >= 0 else None
        if v < 0 or (root is not None and root[0] in finder.params) or not finder.reaches(v, finder.roles.params):
            return False
    return True


def _feeds_weight(finder: _BlockFinder, v: int) -> bool:
    """Does `v` reach, before any other contraction, a matmul that reads a parameter?"""
    prog, seen, todo = finder.prog, {v}, [v]
    while todo:
        for u in prog.users[todo.pop()]:
            op = prog.ops[u]
            if op.primitive in CONTRACTIONS:
                roots = (weight_dims(prog, x) for x in op.operands if x >= 0)
                if any(r is not None and r[0] in finder.params for r in roots):
                    return True
                continue
            fresh = [r for r in op.results if r >= 0 and r not in seen]
            seen.update(fresh)
            todo += fresh
    return False


class Cut(NamedTuple):
    """Where a matmul's result is cut into pieces: the op that cuts it, the pieces, the
    dim of theirs to split and how it was cut (for `LeftOut.detail`)."""

    op: int
    pieces: tuple[int, ...]
    dim: int
    note: str


def _cut(prog, op, use: Use, dim: int) -> Cut | None:
    """How the result of `op` (or an elementwise function of it, such as a bias add) is
    cut along the dim that weight dim `dim` becomes: by a `split`, by slices, or by a
    reshape that makes its pieces a dim of their own (a fused `[q; k; v]` viewed as
    `[3, heads, head_dim]`); None when it is not."""
    if op.primitive != "dot_general" or op.results[0] < 0:
        return None
    rule = op.rule
    factor = rule.operands[use.operand][use.dims.index(dim)]
    out_dim = next((d for d, fs in enumerate(rule.results[0]) if fs == factor), None)
    if out_dim is None:
        return None
    classes = prog.classes
    for v in classes.members[classes.of[op.results[0]]]:
        slices = []
        for u in prog.users[v]:
            user = prog.ops[u]
            if user.primitive == "split" and user.eqn.params["axis"] == out_dim:
                return _pieces(prog, u, tuple(r for r in user.results if r >= 0), out_dim)
            if user.primitive == "slice" and _slices_only(user, out_dim):
                slices.append(u)
            view = _view(prog, user, out_dim) if user.primitive == "reshape" else None
            if view is not None:
                return view
        if len(slices) > 1:
            return _pieces(prog, slices[0], tuple(prog.ops[u].results[0] for u in slices), out_dim)
    return None


def _where(prog, op: int) -> str:
    """Where the user's code made op `op`'s first result (`split@model.py:12`)."""
    return prog.name(prog.ops[op].results[0]).split("#")[0]


def _pieces(prog, op: int, pieces: tuple[int, ...], dim: int) -> Cut:
    return Cut(op, pieces, dim, f"cut into {len(pieces)} pieces by {_where(prog, op)}: a split of it would cross their "
                                "boundaries")


def _view(prog, op, dim: int) -> Cut | None:
    """The cut a reshape makes when it takes operand dim `dim` apart into several dims
    (`[3 * heads * head_dim]` into `[3, heads, head_dim]`): its result, to be split on
    the dim of the second part (the heads), since a split of `dim` splits the first;
    None when the reshape keeps the dim whole."""
    parts, res = op.rule.operands[0][dim], op.results[0]
    if len(parts) < 2 or res < 0:
        return None
    heads = next((d for d, fs in enumerate(op.rule.results[0]) if fs and fs[0] == parts[1]), None)
    if heads is None:
        return None
    sizes = [op.rule.sizes[f] for f in parts]
    return Cut(op.id, (res,), heads, f"viewed as {sizes} by {_where(prog, op.id)}: a split of it would split the part "
                                     f"of size {sizes[0]}, not its part of size {sizes[1]} (dim {heads} of the view)")


def _slices_only(op, dim: int) -> bool:
    """Does this slice take a contiguous range of `dim` and every other dim whole?"""
    p = op.eqn.params
    shape = op.eqn.invars[0].aval.shape
    strides = p.get("strides") or (1,) * len(shape)
    return all((p["start_indices"][d], p["limit_indices"][d]) == (0, shape[d]) or d == dim for d in range(len(shape))) \
        and strides[dim] == 1 and p["limit_indices"][dim] - p["start_indices"][dim] < shape[dim]
