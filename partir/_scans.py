"""The layer scans of a program: a forward `scan` over stacked layers and its transpose,
the backward `scan` of a differentiated train step, paired from the dataflow.

A train step written with `jax.lax.scan` over layers holds two loops after
`jax.value_and_grad`: the forward scan (carry: the activation; stacked inputs: the
layers' parameters; stacked outputs: each layer's residuals) and the backward scan run
in reverse (carry: the activation's gradient; stacked inputs: the residuals and the
parameters again; stacked outputs: the parameters' gradients). The forward's stacked
residuals are the backward's stacked inputs, which is how the two are paired here (a
value is the same across call boundaries, `call_roots`). Pipeline parallelism
(`partir._pipeline`) runs both as stages over a mesh axis.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.extend.core import Literal

from ._graph import call_roots
from ._nested import Link, split_operands


@dataclass(frozen=True)
class ScanCall:
    """One scan equation seen from its caller: the body region `body`, the region it is
    called in (`parent`) and the equation's index there, its `length` and direction, and
    the value ids of its operands (`consts`, `carry`, `xs`: outer, stacked on a leading
    layer dim) and results (`carry_out`, `ys`: stacked), -1 for a literal or a dropped
    result. `rolled`: the scan was rolled from unrolled layers (`partir.roll_layers`),
    so its stacked inputs are made in the step from per-layer arrays."""

    body: int
    parent: int
    index: int
    length: int
    reverse: bool
    consts: tuple[int, ...]
    carry: tuple[int, ...]
    xs: tuple[int, ...]
    carry_out: tuple[int, ...]
    ys: tuple[int, ...]
    rolled: bool = False

    @property
    def stacked(self) -> tuple[int, ...]:
        """The outer values with a leading layer dim: the stacked inputs and outputs."""
        return tuple(v for v in self.xs + self.ys if v >= 0)


@dataclass(frozen=True)
class LayerScans:
    """A forward layer scan (`forward`) and the backward scan that reads its stacked
    residuals (`backward`, None in a program without a backward pass)."""

    forward: ScanCall
    backward: ScanCall | None

    @property
    def calls(self) -> tuple[ScanCall, ...]:
        """The scans, forward first."""
        return (self.forward,) if self.backward is None else (self.forward, self.backward)


def var_ids(program, rid: int) -> dict:
    """Region `rid`'s jaxpr variables -> their value ids."""
    return program.analysis(_var_ids, rid)


def _var_ids(program, rid: int) -> dict:
    region = program.regions[rid]
    jaxpr = region.jaxpr
    ids = dict(zip(jaxpr.constvars, region.constvars))
    ids.update(zip(jaxpr.invars, region.invars))
    for eqn, vids in zip(jaxpr.eqns, region.eqn_results):
        ids.update((var, v) for var, v in zip(eqn.outvars, vids) if v >= 0)
    return ids


def stacked_outputs(program) -> dict[int, int]:
    """Per value a scan body stacks as an output (`ys`), the stack its scan makes of it;
    kept with the program (read it, do not change it)."""
    return program.analysis(_stacked_outputs)


def _stacked_outputs(program) -> dict[int, int]:
    return {op.operands[0]: op.results[0] for op in program.ops if op.link and op.primitive == Link.SCAN_YS}


def scan_call(program, body: int) -> ScanCall:
    """The scan equation whose body is region `body`."""
    return program.analysis(_scan_call, body)


def _scan_call(program, body: int) -> ScanCall:
    parent = program.regions[program.regions[body].parent]
    index = next(i for i, c in parent.children.items() if body in c)
    eqn = parent.jaxpr.eqns[index]
    ids = var_ids(program, parent.id)
    ins = split_operands(eqn, [-1 if isinstance(x, Literal) else ids[x] for x in eqn.invars])
    outs = parent.eqn_results[index]
    nk = len(ins.carry)
    return ScanCall(body, parent.id, index, int(eqn.params["length"]), bool(eqn.params["reverse"]),
                    tuple(ins.consts), tuple(ins.carry), tuple(ins.xs), tuple(outs[:nk]), tuple(outs[nk:]),
                    parent.parent < 0 and index in program.rolled)


def layer_scans(program) -> tuple[LayerScans, ...]:
    """The program's forward layer scans (a forward pass's scans with stacked inputs, in
    program order), each with the backward scan reading its stacked outputs."""
    return program.analysis(_layer_scans)


def _layer_scans(program) -> tuple[LayerScans, ...]:
    from ._remat import layers_of

    roots = call_roots(program)
    scans = [scan_call(program, r.id) for r in program.regions if r.kind == "scan"]
    out = []
    for layer in layers_of(program):
        if layer.loop < 0:
            continue
        fwd = scan_call(program, layer.loop)
        if not fwd.xs:
            continue
        made = {roots[v] for v in fwd.ys if v >= 0}
        bwd = next((s for s in scans if s.body != fwd.body and any(v >= 0 and roots[v] in made for v in s.xs)), None)
        out.append(LayerScans(fwd, bwd))
    return tuple(out)


def body_regions(program, body: int) -> tuple[int, ...]:
    """Region `body` and every region nested in it."""
    inside = {body}
    for r in program.regions:  # a parent comes before its children
        if r.parent in inside:
            inside.add(r.id)
    return tuple(sorted(inside))
