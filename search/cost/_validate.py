"""Check the cost model against what XLA really compiles for a plan.

`compare_with_xla(part, args)` lowers the partitioning, compiles it, and sets side by
side per collective kind the count and bytes per device that the model predicts and
that the compiled HLO contains, plus per-device flops, argument bytes and peak memory
(XLA's: temp + arguments + outputs - aliased, from `compiled.memory_analysis()`). Collectives
are compared per occurrence in the program text (a loop body counted once on both
sides, as the HLO shows it once), and per kind in total, because XLA combines several
all-reduces into one tuple-shaped all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import partir

from ._model import CostModel


@dataclass(frozen=True)
class Fidelity:
    """Model vs XLA for one plan. `kinds` maps a collective kind to
    `(model count, model bytes, xla count, xla bytes)`; flops and argument bytes are per
    device (flops with loop bodies counted once, as XLA's analysis does)."""

    kinds: dict
    flops_model: float
    flops_xla: float
    args_model: float
    args_xla: float
    memory_model: float = 0.0
    memory_xla: float = 0.0

    def bytes_error(self, kind: str) -> float:
        """Relative error of the model's total bytes for `kind` (0 when both are 0)."""
        _, mb, _, xb = self.kinds[kind]
        return abs(mb - xb) / max(xb, mb, 1.0) if (mb or xb) else 0.0

    @property
    def memory_ratio(self) -> float:
        """Modeled peak memory over XLA's (temp + arguments + outputs - aliased)."""
        return self.memory_model / self.memory_xla if self.memory_xla else 1.0

    def rows(self):
        """(kind, model count, model bytes, xla count, xla bytes, relative error) rows."""
        return [(k, *v, self.bytes_error(k)) for k, v in sorted(self.kinds.items())]


def compare_with_xla(part, args, *, device="cpu", mesh=None, backend="jit", donate_argnums=()) -> Fidelity:
    """Compile `part`'s plan for `args` (arrays or ShapeDtypeStructs), lowered by
    `backend` (`partir.lower`'s) with `donate_argnums` donated, and compare with the
    model of that lowering (`CostModel`'s `backend` and `donate_argnums`)."""
    mesh = mesh if mesh is not None else part.mesh.jax_mesh()
    compiled = partir.lower(part, mesh, backend=backend, donate_argnums=donate_argnums).lower(*args).compile()
    cols = partir.collectives(compiled.as_text(), mesh)
    cost = CostModel(part, device, backend=backend, donate_argnums=donate_argnums).cost()
    kinds: dict[str, list] = {}
    for c in cost.collectives:
        e = kinds.setdefault(c.kind, [0, 0.0, 0, 0.0])
        e[0] += 1
        e[1] += c.bytes
    for c in cols:
        e = kinds.setdefault(c.kind, [0, 0.0, 0, 0.0])
        e[2] += 1
        e[3] += c.result_bytes
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    mem = compiled.memory_analysis()
    return Fidelity(
        kinds={k: tuple(v) for k, v in kinds.items()},
        flops_model=cost.flops_loops_once,
        flops_xla=float(analysis.get("flops", 0.0)),
        args_model=cost.argument_bytes,
        args_xla=float(mem.argument_size_in_bytes),
        memory_model=cost.memory_peak,
        memory_xla=float(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
                         - mem.alias_size_in_bytes),
    )
