"""The expert baseline of the benchmarks: every schedule a practitioner would write for
a program and a mesh, each applied and costed once (no search), and the best of them.

The candidates come from the program's structure and the mesh. Data axes are every
axis of size > 1; tensor and expert parallelism go on the innermost of them (the axis
whose devices share the fastest links), the others stay data axes:

- data parallelism over every axis: plain (`dp`), ZeRO stage 1 or 2 (`zero1`,
  `zero2`), FSDP (ZeRO-3, `fsdp`), and, on a mesh of two axes or more, data parallel
  over the outer axes with FSDP over the innermost (`dp+fsdp`, hybrid sharding);
- tensor parallelism (`Megatron`, `tp`) with and without sequence parallelism (`sp`),
  the other axes data parallel as plain, ZeRO-1/2 or FSDP, FSDP written before
  (`fsdp+tp`) and after (`tp+fsdp`) the tensor parallelism, and hybrid over them
  (`dp+tp+fsdp`, MaxText's recipe);
- for a mixture of experts: GShard's expert parallelism (`ep`: experts and tokens over
  the axis, all-to-all between them) or the expert weights alone split over it
  (`experts`: every device routes its tokens, computes its experts' share, and the
  combine sums over the axis), the other axes data parallel or FSDP;
- for a program with self-attention on a mesh of three axes or more: context parallelism
  on the second innermost axis (`cp`, all-gathered keys and values; `cp-zigzag`, the
  tokens laid out balanced) with tensor parallelism on the innermost and FSDP or data
  parallelism on the outer axes (MaxText's and NeMo's long-sequence recipes);

each with rematerialization off, `Remat("dots")` and `Remat("full")`. A candidate that
does not apply (a tactic raises: Megatron finds no block, no layers to rematerialize, an
axis does not divide the batch) is kept with why, so a listing shows what was skipped.
The best candidate is the fastest that fits the memory limit, else the one with the
smallest peak.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import partir
import search
import tactics as T
from partir import PartitioningError

#: Rematerialization policies each candidate is also tried with (None: no remat), as
#: practitioners turn on activation checkpointing at scale (MaxText's remat_policy).
REMAT = (None, "dots", "full")
#: ZeRO stages offered beside FSDP (stage 3, which `FSDP` is).
ZERO_STAGES = (1, 2)
#: How many of the best candidates on a ranking program `expert` costs again on the
#: program itself: the two forms cost within a few percent of each other
#: (`tests/test_scale.py`), which can swap close candidates.
EXACT_TRIES = 3


@dataclass(frozen=True)
class Candidate:
    """One expert schedule: a name that says its tactics and axes, and the tactics."""

    name: str
    schedule: tuple


@dataclass(frozen=True)
class Costed:
    """A candidate's modeled step time (s), peak memory per device (bytes) and whether it
    fits, or why it does not apply (`error`; the numbers are then None)."""

    name: str
    step_s: float | None = None
    peak_bytes: float | None = None
    fits: bool = False
    error: str | None = None

    def to_json(self) -> dict:
        """The fields as a dict (a benchmark's JSON listing)."""
        return dataclasses.asdict(self)


def _axes_text(axes) -> str:
    return ",".join(axes)


def _data_families(data):
    """(name, tactics) of the data-parallel families over the axes `data`."""
    names = _axes_text(data)
    dp = [T.DataParallel(a) for a in data]
    out = [(f"dp({names})", dp)]
    out += [(f"zero{s}({names})", dp + [T.ZeRO(a, stage=s) for a in data]) for s in ZERO_STAGES]
    out.append((f"fsdp({names})", [T.FSDP(a, leave_room=False) for a in data]))
    if len(data) > 1:
        outer, inner = data[:-1], data[-1]
        out.append((f"dp({_axes_text(outer)})+fsdp({inner})",
                    [T.DataParallel(a) for a in outer] + [T.FSDP(inner, leave_room=False)]))
    return out


def _tensor_families(data, axis):
    """(name, tactics) of tensor parallelism over `axis` (with and without sequence
    parallelism), the axes `data` data parallel in each of their ways."""
    out = []
    names = _axes_text(data)
    for sp in (False, True):
        tp = [T.Megatron(axis)] + ([T.SequenceParallel(axis)] if sp else [])
        tp_name = f"tp({axis})" + (f"+sp({axis})" if sp else "")
        if not data:
            out.append((tp_name, tp))
            continue
        dp = [T.DataParallel(a) for a in data]
        out.append((f"dp({names})+{tp_name}", dp + tp))
        out += [(f"zero{s}({names})+{tp_name}", dp + tp + [T.ZeRO(a, stage=s) for a in data]) for s in ZERO_STAGES]
        out.append((f"fsdp({names})+{tp_name}", [T.FSDP(a) for a in data] + tp))
        out.append((f"{tp_name}+fsdp({names})", tp + [T.FSDP(a) for a in data]))
        if len(data) > 1:
            outer, inner = data[:-1], data[-1]
            out.append((f"dp({_axes_text(outer)})+{tp_name}+fsdp({inner})",
                        [T.DataParallel(a) for a in outer] + tp + [T.FSDP(inner)]))
    return out


def _expert_families(program, data, axis):
    """(name, tactics) of expert parallelism over `axis` for a program with expert
    weights, the axes `data` data parallel or FSDP; none for a program without."""
    r = T.roles(program)
    weights = T.expert_weights(program, set(r.params), r.forward_end)
    if not weights:
        return []
    by_dim: dict[int, list[str]] = {}
    for w, d in weights:
        by_dim.setdefault(d, []).append(re.escape(program.name(w)))
    alone = [T.Shard("re:^(" + "|".join(names) + ")$", d, axis) for d, names in sorted(by_dim.items())]
    names = _axes_text(data)
    out = []
    for kind, split in (("ep", [T.ExpertParallel(axis)]), ("experts", alone)):
        out.append((f"{kind}({axis})" + (f"+dp({names})" if data else ""), split + [T.DataParallel(a) for a in data]))
        if data:
            out.append((f"{kind}({axis})+fsdp({names})", split + [T.FSDP(a, leave_room=False) for a in data]))
    return out


def _context_families(program, axes):
    """(name, tactics) of context parallelism on the second innermost of `axes` with
    tensor parallelism on the innermost, the outer axes FSDP or data parallel; none for
    a program without self-attention or a mesh of fewer than three axes."""
    if len(axes) < 3 or not partir.attentions(program):
        return []
    outer, axis, inner = axes[:-2], axes[-2], axes[-1]
    names = _axes_text(outer)
    out = []
    for balance in (None, "zigzag"):
        cp = [T.ContextParallel(axis, balance=balance)]
        cp_name = f"cp{'-' + balance if balance else ''}({axis})"
        tp = [T.Megatron(inner)]
        out.append((f"fsdp({names})+tp({inner})+{cp_name}", tp + cp + [T.FSDP(a) for a in outer]))
        out.append((f"dp({names})+tp({inner})+{cp_name}", [T.DataParallel(a) for a in outer] + tp + cp))
    return out


def candidates(program, mesh) -> list[Candidate]:
    """The expert schedules for `program` on `mesh` (see the module docstring), each
    without and with every rematerialization policy of `REMAT`."""
    axes = [a for a in mesh.names if mesh.size(a) > 1]
    if not axes:
        return []
    data, inner = axes[:-1], axes[-1]
    families = (_data_families(axes) + _tensor_families(data, inner) + _expert_families(program, data, inner)
                + _context_families(program, axes))
    return [Candidate(name + (f"+remat({policy})" if policy else ""),
                      tuple(schedule) + ((T.Remat(policy),) if policy else ()))
            for name, schedule in families for policy in REMAT]


class _Applier:
    """Applies schedules to one program, keeping the partitioning (and the tactics'
    context) reached after every prefix of tactics in applied order: candidates share
    most of their tactics (the remat policies end alike schedules; FSDP written before or
    after Megatron is applied after it either way), so each prefix is applied once."""

    def __init__(self, program, mesh):
        self.reached: dict[tuple, object] = {(): (partir.Partitioning(program, mesh), T.Context())}

    def apply(self, order: tuple):
        """The partitioning `order` (tactics in applied order) reaches, or why it fails
        (a string)."""
        k = len(order)
        while order[:k] not in self.reached:
            k -= 1
        got = self.reached[order[:k]]
        if isinstance(got, str):
            return got
        part, ctx = got
        for i in range(k, len(order)):
            part, ctx = part.copy(), ctx.copy()
            try:
                part, _ = order[i].apply(part, ctx)
            except PartitioningError as e:
                self.reached[order[:i + 1]] = why = f"{order[i]}: {str(e).splitlines()[0]}"
                return why
            self.reached[order[:i + 1]] = (part, ctx)
        return part


def cost_all(program, mesh, *, device: str, memory_limit: float | None = None, among=None) -> list[Costed]:
    """Every candidate for `program` on `mesh` (or those of `among`), applied and costed
    once on `device`'s model, in order (candidates that apply the same tactics in the
    same order are costed once)."""
    applier = _Applier(program, mesh)
    costs: dict[tuple, Costed] = {}
    out = []
    for cand in candidates(program, mesh) if among is None else among:
        order = tuple(t for t, _ in T.applied_order(cand.schedule))
        if order not in costs:
            part = applier.apply(order)
            if isinstance(part, str):
                costs[order] = Costed(cand.name, error=part)
            else:
                c = search.CostModel(part.copy(), device, memory_limit=memory_limit).cost(top=0)
                costs[order] = Costed(cand.name, c.step_time, c.memory_peak, bool(c.fits))
        out.append(dataclasses.replace(costs[order], name=cand.name))
    return out


def expert(program, mesh, *, device: str, memory_limit: float | None = None,
           ranking=None) -> tuple[Costed | None, list[Costed]]:
    """`(best, costed)`: every candidate costed (`cost_all`) and the best one. With a
    `ranking` program (one that costs as `program` does but faster to apply tactics to
    and cost, e.g. the scanned form of an unrolled model, `tests/test_scale.py`), the
    candidates are costed on it and the `EXACT_TRIES` best of them again on `program`,
    the best of which is returned; `costed` is then the ranking program's."""
    costed = cost_all(ranking if ranking is not None else program, mesh, device=device, memory_limit=memory_limit)
    if ranking is None:
        return best(costed), costed
    by_name = {c.name: c for c in candidates(program, mesh)}
    left, top = [c for c in costed if c.error is None], []
    while left and len(top) < EXACT_TRIES:
        top.append(best(left))
        left.remove(top[-1])
    return best(cost_all(program, mesh, device=device, memory_limit=memory_limit,
                         among=[by_name[c.name] for c in top])), costed


def best(costed) -> Costed | None:
    """The fastest candidate that fits, else the one with the smallest peak; None when
    none applies."""
    ok = [c for c in costed if c.error is None]
    fitting = [c for c in ok if c.fits]
    if fitting:
        return min(fitting, key=lambda c: c.step_s)
    return min(ok, key=lambda c: c.peak_bytes) if ok else None


def listing(costed) -> list[str]:
    """One line per candidate: modeled step, peak and fit, or why it was skipped."""
    lines = []
    for c in costed:
        if c.error is not None:
            lines.append(f"  {c.name}: skipped ({c.error})")
        else:
            lines.append(f"  {c.name}: step {c.step_s * 1e3:.1f} ms, peak {c.peak_bytes / 2**30:.1f} GiB"
                         + ("" if c.fits else " (does not fit)"))
    return lines
