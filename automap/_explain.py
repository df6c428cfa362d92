"""`Plan.explain()` / `automap show`: the plan as tables."""

from __future__ import annotations

import math

from rich.table import Table

import tactics
from search import bytes_str, collectives_table, time_str

from ._console import table_console


def attribution(plan) -> dict:
    """Input -> {mesh axis: the tactic whose decision put that axis on it}, found by
    replaying the plan's decisions and noting what each one (with its propagation)
    changed on the inputs."""
    import partir

    prog, part = plan.program, plan.partitioning
    replay = partir.Partitioning(prog, plan.mesh, detached=part.detached)
    before = {v: set() for v in prog.inputs}
    out: dict = {v: {} for v in prog.inputs}
    for d in part.decisions:
        replay.redo(d)
        for v in prog.inputs:
            now = set(replay.tiling(v).axes())
            for a in now - before[v]:
                out[v].setdefault(a, d.source)
            before[v] = now
    return out


def parameter_rows(plan):
    """One row per group of parameters alike (the same weight of every layer): label,
    count, spec of the first, bytes per device in total, and which tactic put each mesh
    axis on it (directly or by propagation)."""
    prog, part = plan.program, plan.partitioning
    r = tactics.roles(prog)
    credit = attribution(plan)
    rows = []
    for g in tactics.input_groups(prog, r.params):
        v0 = g.members[0]
        t = part.tiling(v0)
        per_device = sum(prog.values[v].nbytes // part.tiling(v).num_shards(plan.mesh) for v in g.members)
        source = "; ".join(f"{a}: {credit[v0][a]}" for a in t.axes() if a in credit[v0]) or "-"
        rows.append((g.label, len(g.members), str(t), per_device, source))
    return rows


def alternatives(plan):
    """(name, modeled step time) of the reference plans beside this one: everything
    replicated, pure data parallelism over all axes, and the best plan the search
    rejected (when a search ran)."""
    import partir
    import search

    prog = plan.program
    out = []
    rep = partir.Partitioning(prog, plan.mesh)
    out.append(("replicated", search.CostModel(rep, plan.device, memory_limit=plan.memory_limit).cost()))
    dp = partir.Partitioning(prog, plan.mesh)
    try:
        for axis in plan.mesh.names:
            tactics.DataParallel(axis).apply(dp, tactics.Context())
        out.append(("data parallel (all axes)", search.CostModel(dp, plan.device,
                                                                 memory_limit=plan.memory_limit).cost()))
    except partir.PartitioningError:
        pass
    if plan.search is not None and plan.search.alternatives:
        result, groups = plan.search, plan.search.groups
        actions, t, _ = result.alternatives[0]
        out.append(("best rejected by the search: " + "; ".join(a.describe(groups) for a in actions) or "stop", t))
    return out


def pipeline_tables(plan) -> list:
    """Per pipeline of the plan, a table of which layers each stage's devices run and a
    line with the schedule, microbatches, modeled bubble, point-to-point bytes and
    per-device layer state and residuals."""
    import search

    part, out = plan.partitioning, []
    for pipe in part.pipelines:
        c = search.pipeline_cost(part, pipe, plan.device)
        table = stage_table(pipe.axis, pipe.scans.forward.length, pipe.repeats, part.mesh.names, part.mesh.shape)
        out += [table, f"{_schedule_text(pipe.schedule, pipe.repeats, c.microbatches, c.bubble)}; "
                       f"{bytes_str(c.p2p_bytes[0])} per microbatch per stage boundary; per device "
                       f"{bytes_str(c.stage_bytes)} of layer state, {bytes_str(c.in_flight_bytes)} of residuals"]
    return out


def saved_pipeline_tables(data: dict) -> list:
    """`pipeline_tables` from a plan file's content alone: the stages, the schedule,
    microbatches and bubble (the layer count read off the stacked input's shape)."""
    import search

    names, sizes = list(data["mesh"]), list(data["mesh"].values())
    shapes = {i["name"]: i["shape"] for i in data["inputs"]}
    out = []
    for p in data.get("pipelines", []):
        stages, repeats, m = data["mesh"][p["axis"]], int(p.get("repeats", 1)), int(p["microbatches"])
        out += [stage_table(p["axis"], shapes[p["layers"]][0], repeats, names, sizes),
                _schedule_text(p["schedule"], repeats, m, search.pipeline_bubble(stages, m, repeats))]
    return out


def stage_table(axis: str, layers: int, repeats: int, names, sizes) -> Table:
    """Which layers each stage over `axis` runs, chunk by chunk (`partir.StageSplit`;
    uneven ones marked with their padding slots), and its devices."""
    import partir

    stages = dict(zip(names, sizes))[axis]
    split = partir.StageSplit(layers, stages, repeats=repeats)
    table = Table(title=f"pipeline stages over {axis!r}" + (" (uneven)" if split.uneven else ""))
    for col in ("stage", "layers", "devices"):
        table.add_column(col, justify="right" if col == "stage" else "left")
    for s in range(stages):
        devices = [d for d in range(math.prod(sizes)) if _coord(d, names, sizes, axis) == s]
        ran = ", ".join(f"{r[0]}..{r[-1]}" for r in split.stage_layers(s))
        pad = split.slots - split.count(s)
        ran += f" + {pad} padding slot{'s' * (pad > 1)}" if pad else ""
        table.add_row(str(s), ran, ", ".join(map(str, devices)))
    return table


def _schedule_text(schedule: str, repeats: int, microbatches: int, bubble: float) -> str:
    kind = "interleaved: virtual stages" if schedule == "1f1b" else "circular"
    rounds = f", {repeats} repeats ({kind})" if repeats > 1 else ""
    return f"schedule {schedule}{rounds}, {microbatches} microbatches, modeled bubble {bubble:.0%}"


def _coord(device: int, names, sizes, axis: str) -> int:
    """Device `device`'s (its position in the mesh, row-major) index along `axis`."""
    for name, size in reversed(list(zip(names, sizes))):
        if name == axis:
            return device % size
        device //= size
    raise ValueError(f"no axis {axis!r}")


def explain(plan, console=None) -> None:
    """Print the plan's explanation."""
    console = table_console(console)
    cost = plan.cost
    console.print(f"[bold]plan[/] for {plan.program} on mesh {plan.mesh} ({plan.device})", highlight=False)
    if plan.history:
        for i, step in enumerate(plan.history):
            console.print(f"  {i + 1}. {step.tactic}" + (f" [skipped: {step.skipped}]" if step.skipped else ""),
                          markup=False, highlight=False)
            for note in step.notes:
                console.print(f"       {note}", markup=False, highlight=False)

    params = Table(title="parameters (groups of layers alike)")
    for col in ("parameter", "count", "spec", "bytes/device", "split by"):
        params.add_column(col, justify="right" if col in ("count", "bytes/device") else "left",
                          no_wrap=col in ("parameter", "spec"))
    for label, n, spec, per_device, source in parameter_rows(plan):
        params.add_row(label, str(n), spec, bytes_str(per_device), source)
    console.print(params)

    console.print(collectives_table(cost, "collectives per step, by mesh axis (modeled)"))
    for table in pipeline_tables(plan):
        console.print(table, highlight=False)

    mem = Table(title=f"memory: peak {bytes_str(cost.memory_peak)} of {bytes_str(cost.memory_limit)} per device"
                      + ("" if cost.fits else " (does not fit)"))
    mem.add_column("live at the peak", no_wrap=True)
    mem.add_column("bytes", justify="right")
    for name, b in cost.memory_at_peak[:8]:
        mem.add_row(name, bytes_str(b))
    console.print(mem)

    steps = Table(title="modeled step time")
    steps.add_column("plan")
    steps.add_column("step time", justify="right")
    steps.add_column("vs this plan", justify="right")
    def ratio(t):  # a program that computes nothing takes no time: no ratio to show
        return f"{t / cost.step_time:.2f}x" if cost.step_time > 0 else "-"

    steps.add_row("this plan", time_str(cost.step_time), ratio(cost.step_time))
    steps.add_row("this plan, gradient reductions overlapped", time_str(cost.step_time_overlap),
                  ratio(cost.step_time_overlap))
    for name, other in alternatives(plan):
        t = other if isinstance(other, float) else other.step_time
        fits = "" if isinstance(other, float) or other.fits else " (does not fit)"
        steps.add_row(name + fits, time_str(t), ratio(t))
    console.print(steps)


def explain_saved(data: dict, console=None) -> None:
    """Print a plan file's content (for `automap show` without the program)."""
    console = table_console(console)
    mesh = ",".join(f"{k}={v}" for k, v in data["mesh"].items())
    console.print(f"[bold]plan[/] on mesh {mesh} ({data.get('device')}), lowering {data.get('lowering', 'jit')}, "
                  f"automap {data.get('automap_version')}", highlight=False)
    for i, s in enumerate(data.get("schedule", [])):
        console.print(f"  {i + 1}. {s}", markup=False, highlight=False)
    for a in (data.get("search") or {}).get("actions", []):
        console.print(f"       search: {a}", markup=False, highlight=False)
    for p in data.get("pipelines", []):
        console.print(f"  pipeline: the layer scan reading {p['layers']} in stages over {p['axis']!r}, "
                      f"{p['microbatches']} microbatches, schedule {p['schedule']}"
                      + (f", {p['repeats']} repeats (circular)" if p.get("repeats", 1) > 1 else ""),
                      markup=False, highlight=False)
    for item in saved_pipeline_tables(data):
        console.print(item, highlight=False)
    params = Table(title="inputs and their layouts")
    params.add_column("input", no_wrap=True)
    params.add_column("shape", justify="right")
    params.add_column("spec", no_wrap=True)
    decided = {d.get("name"): d.get("source", "") for d in data["decisions"]}
    params.add_column("decided by")
    for item in data["inputs"]:
        spec = "P(" + ", ".join("None" if e is None else repr(e) if isinstance(e, str) else repr(tuple(e))
                                for e in item["spec"]) + ")"
        params.add_row(item["name"], str(tuple(item["shape"])), spec, decided.get(item["name"], "propagation"))
    console.print(params)
    c = data.get("cost")
    if c is None:
        console.print("the file holds no modeled cost", highlight=False)
        return
    comm = Table(title="collectives per step, by mesh axis (modeled)")
    for col in ("axes", "count", "bytes/device", "time"):
        comm.add_column(col, justify="left" if col == "axes" else "right")
    for axes, e in c["collectives_by_axis"].items():
        comm.add_row(axes, f"{e['count']:g}", bytes_str(e["bytes"]), time_str(e["time_s"]))
    console.print(comm)
    console.print(f"modeled step time {time_str(c['step_time_s'])} (compute {time_str(c['compute_time_s'])}, "
                  f"communication {time_str(c['comm_time_s'])}); peak memory {bytes_str(c['memory_peak_bytes'])}"
                  + ("" if c["fits"] else " (does not fit)"), highlight=False)
