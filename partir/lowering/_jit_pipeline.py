"""Pipelined layer scans under the `jit` lowering: each runs as a `jax.shard_map` region
over the plan's mesh, the stage program of the `shard_map` lowering
(`_shardmap_pipeline`), inside the program XLA partitions.

A layer dim split over the stage axis is a layout XLA's partitioner would gather before
a scan reads it (the scan computes whole along its layer dim); the stage program reads
each stage's block in place and sends activations and their gradients between stages
with `ppermute`s, which compile to the collective-permutes the cost model lists. What
enters the region arrives in the plan's layouts at rest (its `in_specs`), and what
leaves it is in theirs (its `out_specs`), so XLA moves nothing at its boundary that the
plan does not. Where the layers recompute residuals, what the backward region needs from
the forward one (`_pipeline_remat`) leaves the one and enters the other the same way.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from jax.extend.core import Literal

from .._graph import made_from_scalars
from .._pipeline import kept_in_slots
from .._scans import var_ids
from .._tiling import Tiling
from ._frame import Frame, _Blocks
from ._shardmap import Interpreter
from ._shardmap_pipeline import run_pipelined


class JitPipelines:
    """The pipelined scans of a plan, by body region, run as `shard_map` regions on
    `mesh` (a lowering mesh). Where the layers recompute residuals, the forward scan's
    region also returns what recomputing needs (`StageRemat.saved_layouts`), kept here
    (`saved`, this trace) for the backward scan's region, which takes it."""

    def __init__(self, part, mesh):
        self.part, self.mesh = part, mesh
        self.interp = Interpreter(part, list(made_from_scalars(part.program)))
        self.saved: dict = {}
        self.blocks = stage_blocks(part)

    def __contains__(self, body: int) -> bool:
        return body in self.interp.pipelined

    def unit(self, rid: int, i: int):
        """The equations of region `rid` from `i` run per microbatch (the head between the
        layer scans, or both scans and the head under 1F1B: `Interpreter.heads`), as the
        index of the first equation after them, or None."""
        got = self.interp.heads.get((rid, i))
        return None if got is None else got[2]

    def run_unit(self, rid: int, i: int, inputs: dict) -> dict:
        """The values leaving the equations of region `rid` from `i` run per microbatch
        (global arrays by value id), from the global arrays of what they read (`inputs`,
        by value id: `unit_reads`), run as a `shard_map` region whose operands and
        results are at rest."""
        part, interp = self.part, self.interp
        run, given, end = interp.heads[(rid, i)]
        reads, outs = unit_values(part.program, rid, i, end)

        def stages(*blocks):
            interp.values, interp.wholes = _Blocks(interp), {}
            frame = Frame(interp)
            for v, b in zip(reads, blocks):
                frame.put(v, b)
            run(interp, *given, frame)
            return tuple(frame.read(v) for v in outs)

        region = jax.shard_map(stages, mesh=self.mesh, in_specs=tuple(part.tiling(v).spec() for v in reads),
                               out_specs=tuple(part.tiling(v).spec() for v in outs), check_vma=False)
        return dict(zip(outs, region(*(inputs[v] for v in reads))))

    def run(self, eqn, body: int, ins, results, operands) -> list:
        """The results (global arrays) of pipelined scan `eqn` (operand value ids `ins`,
        -1 for a literal; result ids `results`) on `operands`."""
        part, interp = self.part, self.interp
        pipe, layout, inner, remat = interp.pipelined[body]
        passed = [k for k, v in enumerate(ins) if v >= 0]
        saved = remat.saved_layouts() if remat is not None else []
        takes = saved if remat is not None and body == remat.bwd else []
        gives = saved if remat is not None and body == remat.fwd else []

        def spec(v: int):  # a recomputed residual's placeholder is a scalar per layer
            if remat is not None and remat.placeholder(v):
                return PartitionSpec(pipe.axis)
            if v in self.blocks:  # uneven stages' residual: [S * slots, ...], a stage's block each
                return Tiling(((pipe.axis,),) + part.tiling(v).dims[1:]).spec()
            return part.tiling(v).spec()

        def stages(*blocks):
            ops = list(operands)
            for k, b in zip(passed, blocks):
                ops[k] = b
            interp.values, interp.wholes = _Blocks(interp), {}
            if takes:
                remat.saved = dict(zip([s for s, _ in takes], blocks[len(passed):]))
            outs = run_pipelined(interp, pipe, layout, inner, remat, eqn, ins, results, ops, {})
            return tuple(outs) + tuple(remat.saved[s] for s, _ in gives)

        region = jax.shard_map(stages, mesh=self.mesh,
                               in_specs=tuple(spec(ins[k]) for k in passed) + tuple(t.spec() for _, t in takes),
                               out_specs=tuple(spec(r) if r >= 0 else PartitionSpec() for r in results)
                               + tuple(t.spec() for _, t in gives), check_vma=False)
        outs = region(*(operands[k] for k in passed), *(self.saved[s] for s, _ in takes))
        self.saved.update(zip([s for s, _ in gives], outs[len(results):]))
        return list(outs[:len(results)])


def unit_values(prog, rid: int, start: int, end: int) -> tuple[list[int], list[int]]:
    """(the values equations [`start`, `end`) of region `rid` read that are made before
    them; the values they make that are read after them)."""
    region, ids = prog.regions[rid], var_ids(prog, rid)
    made = {v for i in range(start, end) for v in region.eqn_results[i] if v >= 0}

    def reads(eqns):
        return [ids[x] for eqn in eqns for x in eqn.invars if not isinstance(x, Literal)]

    ins = list(dict.fromkeys(v for v in reads(region.jaxpr.eqns[start:end]) if v not in made))
    later = set(reads(region.jaxpr.eqns[end:])) | set(region.outvars)
    return ins, [v for i in range(start, end) for v in region.eqn_results[i] if v in made and v in later]


def stage_blocks(part) -> frozenset:
    """The residuals of uneven stages (`partir.StageSplit`) kept as the stages' padded
    blocks between the two scans (`partir.kept_in_slots`): under this lowering one array
    of S * ceil(L/S) layers split over the stage axis, which no constraint on the way
    from one region to the other may gather (the plan holds them whole along it)."""
    out = set()
    for pipe in part.pipelines:
        if pipe.split(part.mesh.size(pipe.axis)).exchanged:
            out |= kept_in_slots(part, pipe)
    return frozenset(out)
