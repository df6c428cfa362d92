"""A readable listing of a partitioned program."""

from __future__ import annotations

import numpy as np

from ._reshard import transition


def _type(value) -> str:
    try:
        dt = np.dtype(value.dtype).name
    except TypeError:
        dt = str(value.dtype)
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int32": "i32",
             "int64": "i64", "bool": "bool", "uint32": "u32", "int8": "i8", "uint8": "u8"}.get(dt, dt)
    return f"{short}[{','.join(map(str, value.shape))}]"


def dump(part, *, ops=None, show_replicated_ops: bool = True) -> str:
    """One line per value/op with its tiling; reshard (`~`) and reduction (`+`) points are
    marked under the op where they happen, with the collectives they imply.

    `ops` restricts the listing to some op ids; `show_replicated_ops=False` hides ops
    whose every value is replicated and that reshard nothing.
    """
    prog = part.program
    mesh = part.mesh
    lines = [f"program on mesh {mesh}: {len(prog.inputs)} inputs, {len(prog.outputs)} outputs, "
             f"{len(prog.values)} values, {len(prog.ops)} ops"]
    deciders = {}
    for d in part.decisions:
        what = (f"tile dim {d.dim} over {d.axis}" if d.action == "tile"
                else f"pin whole over {', '.join(d.axes)}" if d.action == "pin" and d.axes else d.action)
        deciders.setdefault(d.value, []).append(f"{what} by {d.source}")
    lines.append("inputs:")
    for v, n in zip(prog.inputs, prog.input_names):
        why = f"  <- {'; '.join(deciders[v])}" if v in deciders else ""
        lines.append(f"  %{v} {n}: {_type(prog.values[v])} {part.tiling(v)}{why}")
    by_op: dict[int, list] = {}
    for r in part.reshards(ops):
        by_op.setdefault(r.op, []).append(r)
    lines.append("ops:")
    for oid in range(len(prog.ops)) if ops is None else sorted(ops):
        op = prog.ops[oid]
        notes = by_op.get(oid, [])
        vals = [v for v in op.operands + op.results if v >= 0]
        if not show_replicated_ops and not notes and all(part.tiling(v).is_replicated for v in vals):
            continue
        region = prog.regions[op.region]
        where = "" if region.parent < 0 else f"[{region.kind}#{region.id}] "
        args = " ".join(f"%{v}" if v >= 0 else "lit" for v in op.operands)
        res = ", ".join(f"%{v}: {_type(prog.values[v])} {part.tiling(v)}" for v in op.results if v >= 0)
        F = part.factor_tiling(oid)
        fac = ", ".join(f"{op.rule.names[f]}:{'*'.join(ax)}" for f, ax in enumerate(F) if ax)
        lines.append(f"  {where}{res or '()'} = {op.primitive} {args}" + (f"   {{{fac}}}" if fac else ""))
        for r in notes:
            mark = "+" if r.src.partial else "~"
            what = "reduce" if r.src.partial else "reshard"
            cols = ", ".join(map(str, transition(r.src, r.dst, mesh))) or "relayout"
            lines.append(f"      {mark} {what} %{r.value} ({r.side} {r.index}): {r.src} -> {r.dst}   [{cols}]")
    lines.append("outputs:")
    for v, n in zip(prog.outputs, prog.output_names):
        lines.append(f"  {n}: " + (f"%{v} {part.tiling(v)}" if v >= 0 else "literal"))
    return "\n".join(lines)
