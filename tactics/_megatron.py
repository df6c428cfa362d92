"""Megatron tensor parallelism, recognised from the dataflow."""

from __future__ import annotations

from dataclasses import dataclass

from partir import PartitioningError, transition

from ._base import Context, Tactic, TacticError
from ._groups import input_groups
from ._roles import roles, weight_root


@dataclass(frozen=True)
class Block:
    """One tensor-parallel block: the weight split on its output features (column
    parallel) and the ops where the block's partial sums are reduced (row parallel)."""

    weight: int
    dim: int
    op: int
    reductions: tuple[int, ...]


def weight_uses(prog, params, forward_end):
    """Each forward read of a parameter by a matmul, convolution or gather, in op order:
    `(weight input, op, operand, free dims, contracting dims)` in the weight's own dims
    (a scan's stacked weight is offset by its layer dim). Free dims are a matmul
    operand's output features, a kernel's output features, a gather table's indexed
    (vocabulary) dim."""
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
            dn = op.eqn.params["dimension_numbers"]
            picks.append((0, [d for d in dn.collapsed_slice_dims if d in dn.start_index_map], []))
        for k, free, contracting in picks:
            root = weight_root(prog, op.operands[k])
            if root is not None and root[0] in params:
                w, off = root
                out.append((w, op.id, k, tuple(d + off for d in free), tuple(d + off for d in contracting)))
    return out


@dataclass(frozen=True)
class Megatron(Tactic):
    """Megatron-LM tensor parallelism over `axis`, found from the dataflow graph.

    For each weight a forward matmul reads (in program order), it tries splitting the
    weight's output features over `axis` and keeps the split only if propagation closes
    a tensor-parallel block: the matmul's input stays whole, no activation must be
    gathered over `axis`, and some contraction downstream (the row-parallel matmul, a
    softmax over a split vocabulary) turns the split into partial sums. Weights the
    block reaches are split by propagation and not tried again. Names play no part.

    Textbook pattern: MLP = column-parallel then row-parallel matmul, one all-reduce in
    the forward and one in the backward; attention = Q/K/V split by heads, output
    projection row-parallel, likewise; embedding and LM head split on the vocabulary
    (a partial lookup reduced once; softmax statistics reduced over `axis`).
    """

    axis: str

    def apply(self, part, ctx: Context):
        prog = part.program
        r = roles(prog)
        size = part.mesh.size(self.axis)
        blocks, rejected = [], []
        uses = weight_uses(prog, set(r.params), r.forward_end)
        # Layers built alike behave alike: a block found in one layer is taken for every
        # weight of its group (see `input_groups`) without trying each again.
        group_of = {v: g for g in input_groups(prog, r.params) for v in g.members}
        tried = set()
        for w, oid, k, free, _ in uses:
            if len(free) != 1 or (w, free[0]) in tried:
                continue
            dim = free[0]
            tried.add((w, dim))
            t = part.tiling(w)
            if self.axis in t.axes():
                continue  # split already, by a block found earlier
            mark = part.mark()
            try:
                part.tile(w, dim, self.axis, source=str(self))
            except PartitioningError as e:
                rejected.append(f"{prog.name(w)}: {e}")
                continue
            problem, reductions = self._closes(part, mark, prog.ops[oid], k, r.forward_end, uses)
            if problem:
                part.rollback(mark)
                rejected.append(f"{prog.name(w)} dim {dim}: {problem}")
                continue
            blocks.append(Block(w, dim, oid, reductions))
            for other in group_of[w].members:
                tried.add((other, dim))
                if other == w or self.axis in part.tiling(other).axes():
                    continue
                try:
                    part.tile(other, dim, self.axis, source=str(self))
                    blocks.append(Block(other, dim, -1, ()))
                except PartitioningError as e:
                    rejected.append(f"{prog.name(other)}: {e}")
        if not blocks:
            detail = "; ".join(rejected[:4]) or "no parameter is read by a matmul"
            raise TacticError(f"found no tensor-parallel block over {self.axis!r} (size {size}): {detail}")
        ctx.blocks.setdefault(self.axis, []).extend(blocks)
        notes = [f"{len(blocks)} block(s) split over {self.axis!r}: "
                 + ", ".join(f"{prog.name(b.weight)}[dim {b.dim}]" for b in blocks)]
        if rejected:
            notes.append(f"{len(rejected)} weight(s) left out, e.g. {rejected[0]}")
        return part, notes

    def _closes(self, part, mark, op, k, forward_end, uses):
        """Why tiling since `mark` is not a tensor-parallel block (None if it is), and the
        forward ops where its partial sums are reduced."""
        prog = part.program
        act = op.operands[1 - k] if op.primitive in ("dot_general", "conv_general_dilated") else op.operands[1]
        if act >= 0 and self.axis in part.tiling(act).axes():
            return f"its input {prog.name(act)} would be split over {self.axis!r}", ()
        vals, ops = part.changed_since(mark)
        # A block ends in one row-parallel weight (or in reductions alone, as a softmax
        # over a split vocabulary does); a split that reaches several weights on their
        # contracting dims has escaped into the activations that all layers share.
        rows = {w for w, _, _, _, contracting in uses if w in vals
                and any(self.axis in part.tiling(w).dims[d] for d in contracting)}
        if len(rows) > 1:
            names = ", ".join(sorted(prog.name(w) for w in rows)[:3])
            return f"the split spreads into the shared activations (row-split weights: {names})", ()
        reductions, closed = [], False
        for rs in part.reshards(ops):
            if self.axis in rs.src.partial:
                closed = True
                if rs.op < forward_end:
                    reductions.append(rs.op)
                continue
            if prog.rematerializable(rs.value):
                continue
            for step in transition(rs.src, rs.dst, part.mesh):
                if step.kind in ("all-gather", "all-to-all") and self.axis in step.axes:
                    return f"{prog.name(rs.value)} would need an {step.kind} over {self.axis!r}", ()
        if not closed:
            return "no contraction turns the split into partial sums (not a block)", ()
        return None, tuple(sorted(set(reductions)))
