"""What the values of a train step are, read from its dataflow (never from names).

- *state* inputs are carried to an output by elementwise updates (they share a tiling
  class with an output): parameters and optimizer state;
- *parameters* are state inputs that the forward pass reads; *optimizer state* the rest;
- *batch* inputs are the other inputs of rank >= 1.

The forward pass is the ops before the first backward (transposed) op; a program with
no backward pass is all forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from partir import Link

#: Ops a weight may pass through on its way to a matmul without changing its layout.
TRANSPARENT = ("convert_element_type", "copy", "copy_p")


@dataclass(frozen=True)
class Roles:
    """Input roles and the forward/backward split of a program."""

    params: tuple[int, ...]
    opt_state: tuple[int, ...]
    batch: tuple[int, ...]
    forward_end: int  # op index where the backward pass starts (len(ops) if none)

    @property
    def state(self) -> tuple[int, ...]:
        """Parameters and optimizer state."""
        return tuple(sorted(self.params + self.opt_state))


def roles(program) -> Roles:
    """Infer the roles of `program`'s inputs (computed once per program)."""
    return program.analysis(_roles)


def _roles(program) -> Roles:
    cls = program.classes
    backward = program.backward
    forward_end = next((i for i, b in enumerate(backward) if b), len(program.ops))
    out_classes = {cls.of[v] for v in program.outputs if v >= 0}
    read_forward = set()
    for op in program.ops[:forward_end]:
        if op.link or op.primitive in TRANSPARENT:
            continue
        for v in op.operands:
            if v >= 0:
                root = weight_root(program, v)
                if root is not None:
                    read_forward.add(root[0])
    params, opt, batch = [], [], []
    for v in program.inputs:
        if cls.of[v] in out_classes:
            (params if v in read_forward else opt).append(v)
        elif program.values[v].rank >= 1:
            batch.append(v)
    return Roles(tuple(params), tuple(opt), tuple(batch), forward_end)


def weight_root(program, v: int):
    """The program input that `v` is, through links (a scan slices stacked weights: the
    input's dims are then offset by one; a later scan slicing a scan's stacked outputs
    undoes that) and dtype casts: `(input, dim offset)` or None."""
    found = _root(program, v, transposes=False)
    return None if found is None else (found[0], found[2])


def weight_dims(program, v: int):
    """Like `weight_root`, also through transposes (a kernel stored `[out, in]` and used
    as `x @ w.T`): `(input, dims)` where `dims[d]` is the input's dim that dim `d` of `v`
    is, or None."""
    found = _root(program, v, transposes=True)
    return None if found is None else found[:2]


def _root(program, v: int, *, transposes: bool):
    # (input, dims of v in the input, scan layer dims passed) or None.
    dims = list(range(program.values[v].rank))
    offset = 0
    inputs = program.input_set
    for _ in range(64):
        if v in inputs:
            return v, tuple(dims), offset
        p = program.producer[v]
        if p < 0:
            return None
        op = program.ops[p]
        if op.link:
            if op.primitive == Link.SCAN_XS:
                offset += 1
                dims = [d + 1 for d in dims]
            elif op.primitive == Link.SCAN_YS:
                # A scan's stacked output, read back through a later scan's slicing (the
                # backward pass reads the forward's residuals so, e.g. a cast weight):
                # the per-iteration value, one layer dim fewer. A dim of `v` that is the
                # layer dim itself is no dim of the weight.
                if 0 in dims:
                    return None
                offset -= 1
                dims = [d - 1 for d in dims]
        elif op.primitive == "stack" and op.eqn.params["axis"] == 0:
            # Per-layer weights stacked on a leading layer dim (`partir.roll_layers`):
            # the first layer's stands for them all (the stack shares their other dims).
            if 0 in dims:
                return None
            offset -= 1
            dims = [d - 1 for d in dims]
        elif transposes and op.primitive == "transpose":
            dims = [op.eqn.params["permutation"][d] for d in dims]
        elif op.primitive not in TRANSPARENT:
            return None
        v = op.operands[0]
        if v < 0:
            return None
    return None
