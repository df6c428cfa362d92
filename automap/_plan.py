"""`Plan`: a partitioned train step that can be run, explained, saved and loaded."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import partir
from partir import MeshSpec, PartitioningError, Tiling

from . import __version__

#: The plan file format; bump when a field changes meaning.
FORMAT, VERSION = "automap-plan", 1

#: How a plan runs: `jax.jit` with the plan's shardings, XLA's partitioner inserting the
#: collectives ('jit'), or the per-device program with exactly the modeled collectives
#: under `jax.shard_map` ('shard_map').
LOWERINGS = ("jit", "shard_map")


def check_lowering(lowering) -> str:
    """`lowering` if it is one of `LOWERINGS`, else a `PartitioningError` listing them."""
    if lowering not in LOWERINGS:
        raise PartitioningError(f"lowering={lowering!r} is not one of {', '.join(map(repr, LOWERINGS))}: "
                                "'jit' lets XLA place the collectives, 'shard_map' runs exactly the modeled ones")
    return lowering


class PlanError(PartitioningError):
    """A plan that does not fit the program, mesh or file it is used with."""


def fingerprint(program, mesh: MeshSpec, schedule_key: str, device_text, extra="") -> str:
    """A key for a plan: the program's jaxpr, the mesh, the schedule (`schedule_key`: its
    tactics' identities, serialised), the device and the library version. Object
    addresses in the jaxpr text are left out (they differ between processes)."""
    text = re.sub(r"0x[0-9a-f]+", "0x", str(program.closed_jaxpr))
    h = hashlib.sha256()
    for part in (text, str(mesh), schedule_key, device_text, extra, __version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class Plan:
    """A plan for one program on one mesh: the partitioning, how it was reached, what it
    is modeled to cost, and how to run it.

    `in_shardings`/`out_shardings` are pytrees of `NamedSharding` mirroring the
    (non-static) arguments and the outputs; `specs`/`out_specs` the same as
    `PartitionSpec`s; `jit(lowering=)` the sharded callable (by default in the plan's
    `lowering`); `shard_args(*args)` puts arrays where the plan wants them, across
    processes too; `explain()`, `save(path)`, `plot(path)`.
    """

    def __init__(self, partitioning, *, history=(), search=None, device="h100", memory_limit=None,
                 donate_argnums=(), schedule_text=(), jax_mesh=None, key="", lowering="jit"):
        self.partitioning = partitioning
        self.program = partitioning.program
        self.mesh = partitioning.mesh
        self.history = tuple(history)
        self.search = search  # the first search's SearchResult, when a search ran
        self.device = device
        self.memory_limit = memory_limit
        self.donate_argnums = tuple(donate_argnums)
        self.schedule_text = tuple(schedule_text)
        self.key = key
        self.lowering = check_lowering(lowering)
        self._jax_mesh = jax_mesh
        self._cost = None
        self._jitted = {}

    # -- layouts ----------------------------------------------------------------------
    @property
    def jax_mesh(self):
        """The `jax.sharding.Mesh` the plan runs on (the first devices, by default)."""
        if self._jax_mesh is None:
            self._jax_mesh = self.mesh.jax_mesh()
        return self._jax_mesh

    def _tree(self, tree, values, make):
        return jax.tree_util.tree_unflatten(tree, [make(v) for v in values])

    @property
    def specs(self):
        """The arguments' layouts: pytrees of `PartitionSpec` mirroring them."""
        prog = self.program
        return self._tree(prog.in_tree, prog.inputs, lambda v: self.partitioning.tiling(v).spec())

    @property
    def out_specs(self):
        """The outputs' layouts: a pytree of `PartitionSpec` mirroring them."""
        prog = self.program
        return self._tree(prog.out_tree, prog.outputs,
                          lambda v: self.partitioning.tiling(v).spec() if v >= 0 else PartitionSpec())

    @property
    def in_shardings(self):
        """Pytrees of `NamedSharding` mirroring the arguments."""
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.jax_mesh, s), self.specs,
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))

    @property
    def out_shardings(self):
        """A pytree of `NamedSharding` mirroring the outputs."""
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.jax_mesh, s), self.out_specs,
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))

    @property
    def cost(self):
        """The modeled cost on the plan's device (`search.Cost`)."""
        if self._cost is None:
            import search

            self._cost = search.CostModel(self.partitioning.copy(), self.device,
                                          memory_limit=self.memory_limit,
                                          donate_argnums=self.donate_argnums).cost()
        return self._cost

    # -- running ----------------------------------------------------------------------
    def jit(self, lowering: str | None = None):
        """A `jax.jit`-ed callable of the (non-static) arguments with the plan's shardings,
        lowered as `lowering` says (default: the plan's own, see `LOWERINGS`): 'jit'
        constrains the plan's layouts and lets XLA insert the collectives; 'shard_map'
        runs each device's program with exactly the collectives the cost model lists."""
        lowering = self.lowering if lowering is None else check_lowering(lowering)
        if lowering not in self._jitted:
            options = {"free": self._made_from_scalars()} if lowering == "shard_map" else {}
            self._jitted[lowering] = partir.lower(self.partitioning, self.jax_mesh, backend=lowering,
                                                  donate_argnums=self.donate_argnums, **options)
        return self._jitted[lowering]

    def _made_from_scalars(self):
        # What the cost model makes wherever it is read instead of moving it.
        from search._fusion import materialization

        return materialization(self.program).from_scalars

    def shard_args(self, *args, process_local: bool | tuple[int, ...] = False):
        """The (non-static) `args` as global arrays laid out as the plan wants them.

        On one process they are put on the mesh's devices. With several processes
        (`jax.distributed`), each process passes the whole value of an argument (the
        default) or, for the arguments `process_local` names (True: all; or their
        positions), the part that its own devices hold (its rows of the batch): the
        global arrays are built with `jax.make_array_from_callback` or
        `jax.make_array_from_process_local_data`. Arrays already spread over several
        processes (a step's outputs) are laid out as the plan wants, moving only what
        differs."""
        local = range(len(args)) if process_local is True else () if process_local is False else process_local
        return shard_args(self, args, frozenset(local))

    # -- explaining -------------------------------------------------------------------
    def explain(self, console=None) -> None:
        """Print the plan's tables: parameters, collectives by axis, memory, step time."""
        from ._explain import explain

        explain(self, console)

    def plot(self, path) -> None:
        """Save a picture: the search's best cost over time, and how every parameter is
        split over the mesh axes."""
        from ._plot import plot

        plot(self.to_json(), path)

    # -- saving -----------------------------------------------------------------------
    def to_json(self) -> dict:
        """The versioned, human-readable description that `save` writes."""
        prog, part = self.program, self.partitioning

        def entry(v, name):
            val = prog.values[v]
            return {"name": name, "shape": list(val.shape), "dtype": str(np.dtype(val.dtype)) if _plain(val.dtype)
                    else str(val.dtype), "spec": part.tiling(v).to_json()}

        c = self.cost
        out = {
            "format": FORMAT, "version": VERSION, "automap_version": __version__,
            "key": self.key,
            "lowering": self.lowering,
            "mesh": dict(self.mesh.axes),
            "device": self.device if isinstance(self.device, str) else getattr(self.device, "name", str(self.device)),
            "memory_limit": self.memory_limit,
            "donate_argnums": list(self.donate_argnums),
            "schedule": list(self.schedule_text),
            "inputs": [entry(v, n) for v, n in zip(prog.inputs, prog.input_names)],
            "outputs": [entry(v, n) if v >= 0 else {"name": n, "spec": []}
                        for v, n in zip(prog.outputs, prog.output_names)],
            "decisions": [d.to_json(prog) for d in part.decisions],
            "cost": {"step_time_s": c.step_time, "step_time_overlap_s": c.step_time_overlap,
                     "compute_time_s": c.compute_time, "comm_time_s": c.comm_time, "flops": c.flops,
                     "memory_peak_bytes": c.memory_peak, "fits": c.fits,
                     "collectives_by_axis": {",".join(k) or "-": {"count": n, "bytes": b, "time_s": t}
                                             for k, (n, b, t) in c.by_axis().items()}},
        }
        if self.search is not None:
            result, groups = self.search, self.search.groups
            out["search"] = {"episodes": result.stats.episodes, "states": result.stats.states,
                             "cache_hits": result.stats.cache_hits, "elapsed_s": result.stats.elapsed,
                             "stopped": result.stats.stopped, "root_step_time_s": result.root_step_time,
                             "trace": [list(t) for t in result.stats.trace],
                             "actions": [a.describe(groups) for a in result.actions]}
        return out

    def save(self, path) -> None:
        """Write the plan as JSON (see `to_json`)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")

    def __repr__(self) -> str:
        return f"Plan({self.program}, mesh {self.mesh}, {len(self.partitioning.decisions)} decisions)"


def shard_args(plan: Plan, args: tuple, process_local: frozenset):
    """`Plan.shard_args`: `args` placed with `plan`'s input shardings, those at the
    positions `process_local` from each process's part."""
    prog = plan.program
    tree = jax.tree_util.tree_structure(args)
    if tree != prog.in_tree:
        raise PlanError(f"the arguments do not have the structure the plan was made for: expected {prog.in_tree}, "
                        f"got {tree}; pass the same pytrees (non-static arguments only)")
    bad = sorted(k for k in process_local if not (isinstance(k, int) and 0 <= k < len(args)))
    if bad:
        raise PlanError(f"process_local names no argument at {bad}: give positions 0..{len(args) - 1}, "
                        "or True for all")
    shardings = jax.tree_util.tree_leaves(plan.in_shardings)
    if jax.process_count() == 1 and not process_local:
        return jax.device_put(args, jax.tree_util.tree_unflatten(tree, shardings))
    out = []
    for x, sharding, v, arg in zip(jax.tree_util.tree_leaves(args), shardings, prog.inputs, prog.input_args):
        shape = prog.values[v].shape
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            out.append(jax.device_put(x, sharding))  # already global: reshard
        elif arg in process_local:
            out.append(jax.make_array_from_process_local_data(sharding, np.asarray(x), shape))
        else:
            whole = np.asarray(x)
            out.append(jax.make_array_from_callback(shape, sharding, lambda index, whole=whole: whole[index]))
    return jax.tree_util.tree_unflatten(tree, out)


def _plain(dtype) -> bool:
    try:
        np.dtype(dtype)
        return True
    except TypeError:
        return False


class SavedPlan:
    """A plan read from a file, not yet bound to a program: `bind(fn, *args)` checks it
    against the program and returns a `Plan`; `data` is the file's content."""

    def __init__(self, data: dict, path: str = "<dict>"):
        self.data = data
        self.path = path
        self.mesh = MeshSpec(tuple((k, int(v)) for k, v in data["mesh"].items()))

    def bind(self, fn, *args, static_argnums=(), jax_mesh=None) -> Plan:
        """The plan for `fn(*args)`, checked: the mesh, every input's name, shape and
        dtype, and every split's divisibility. A `PlanError` lists everything that does
        not fit. Decisions are replayed when the program is the one the plan was made
        for; otherwise the saved input layouts are applied and propagated."""
        return self.bind_program(partir.lift(fn, *args, static_argnums=static_argnums), jax_mesh)

    def bind_program(self, prog, jax_mesh=None) -> Plan:
        """`bind` for a program already lifted."""
        problems = check(self.data, prog, jax_mesh)
        if problems:
            raise PlanError(f"plan {self.path} does not fit this program:\n  - " + "\n  - ".join(problems))
        part = partir.Partitioning(prog, self.mesh)
        by_name = dict(zip(prog.input_names, prog.inputs))
        replay = all(d.get("name") == _name(prog, d.get("value")) for d in self.data["decisions"])
        if replay:
            try:
                decisions = [partir.Decision.from_json(d, prog) for d in self.data["decisions"]]
            except PartitioningError as e:
                raise PlanError(f"plan {self.path}: {e}") from None
            for d in decisions:
                part.redo(d)
        else:
            for item in self.data["inputs"]:
                v = by_name[item["name"]]
                t = Tiling.from_json(item["spec"])
                for dim, axes in enumerate(t.dims):
                    for a in axes:
                        part.tile(v, dim, a, source=f"plan {self.path}")
        return Plan(part, device=self.data.get("device", "h100"), memory_limit=self.data.get("memory_limit"),
                    donate_argnums=self.data.get("donate_argnums", ()), schedule_text=self.data.get("schedule", ()),
                    jax_mesh=jax_mesh, key=self.data.get("key", ""), lowering=self.data.get("lowering", "jit"))


def _name(prog, v):
    try:
        return prog.name(v) if isinstance(v, int) and 0 <= v < len(prog.values) else None
    except Exception:
        return None


def check(data: dict, prog, jax_mesh=None) -> list[str]:
    """What in plan `data` does not fit program `prog` (and the real mesh, if given)."""
    problems = []
    mesh = MeshSpec(tuple((k, int(v)) for k, v in data["mesh"].items()))
    sizes = mesh.sizes()
    if jax_mesh is not None and dict(jax_mesh.shape) != sizes:
        problems.append(f"the plan is for mesh {mesh} but the mesh given is {dict(jax_mesh.shape)}")
    if mesh.num_devices > len(jax.devices()):
        problems.append(f"mesh {mesh} needs {mesh.num_devices} devices, {len(jax.devices())} are available")
    by_name = dict(zip(prog.input_names, prog.inputs))
    for item in data["inputs"]:
        v = by_name.get(item["name"])
        if v is None:
            problems.append(f"input {item['name']} is not in the program")
            continue
        val = prog.values[v]
        if list(val.shape) != list(item["shape"]):
            problems.append(f"input {item['name']} has shape {tuple(val.shape)}, the plan expects {tuple(item['shape'])}")
            continue
        for d, entry in enumerate(item["spec"]):
            axes = [] if entry is None else [entry] if isinstance(entry, str) else entry
            for a in axes:
                if a not in sizes:
                    problems.append(f"input {item['name']} dim {d} is split over {a!r}, not an axis of {mesh}")
            k = mesh.devices_along(a for a in axes if a in sizes)
            if val.shape[d] % k:
                problems.append(f"input {item['name']} dim {d} (size {val.shape[d]}) is not divisible by the "
                                f"{k} devices of {axes}")
    known = {i["name"] for i in data["inputs"]}
    missing = [n for n in prog.input_names if n not in known]
    if missing:
        problems.append(f"the plan does not know input(s) {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    return problems


def load_plan(path) -> SavedPlan:
    """Read a plan file written by `Plan.save`; `bind(fn, *args)` applies it."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanError(f"no plan file at {path}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{path} is not a plan file (invalid JSON: {e})") from None
    if data.get("format") != FORMAT:
        raise PlanError(f"{path} is not an automap plan (format {data.get('format')!r}, expected {FORMAT!r})")
    if data.get("version") != VERSION:
        raise PlanError(f"{path} has plan format version {data.get('version')}, this automap reads {VERSION}")
    return SavedPlan(data, str(path))
