"""`Plan`: a partitioned train step that can be run, explained, saved and loaded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import threading
import uuid
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import partir
from search import DEFAULT_DEVICE

from ._version import __version__
from ._args import LOWERINGS, check_lowering, output_path, picture_path
from ._errors import PlanError  # noqa: F401  (re-exported: automap._plan.PlanError)

#: The plan file format; bump when a field changes meaning. Version 2 moved the
#: search's timings out of the plan (see `Plan.timings`); version 1 files still load.
FORMAT, VERSION = "automap-plan", 2
READABLE = (1, 2)
__all__ = ["FORMAT", "LOWERINGS", "READABLE", "VERSION", "Plan", "Writes", "shard_args", "stage_plot"]


class Plan:
    """A plan for one program on one mesh: the partitioning, how it was reached, what it
    is modeled to cost, and how to run it.

    `in_shardings`/`out_shardings` are pytrees of `NamedSharding` mirroring the
    (non-static) arguments and the outputs; `specs`/`out_specs` the same as
    `PartitionSpec`s; `jit(lowering=)` the sharded callable (by default in the plan's
    `lowering`); `shard_args(*args)` puts arrays where the plan wants them, across
    processes too; `explain()`, `save(path)`, `plot(path)`.
    """

    def __init__(self, partitioning, *, history=(), search=None, device=DEFAULT_DEVICE, memory_limit=None,
                 donate_argnums=(), schedule_text=(), jax_mesh=None, key="", made_for=None, lowering="jit"):
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
        self.made_for = made_for  # what the key was made from (automap._cache.key_parts)
        self.lowering = check_lowering(lowering, PlanError)
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
                                          donate_argnums=self.donate_argnums, backend=self.lowering).cost()
        return self._cost

    # -- running ----------------------------------------------------------------------
    def jit(self, lowering: str | None = None):
        """A `jax.jit`-ed callable of the (non-static) arguments with the plan's shardings,
        lowered as `lowering` says (default: the plan's own, see `LOWERINGS`): 'jit'
        constrains the plan's layouts and lets XLA insert the collectives; 'shard_map'
        runs each device's program with exactly the collectives the cost model lists."""
        lowering = self.lowering if lowering is None else check_lowering(lowering, PlanError)
        if lowering not in self._jitted:
            options = {"free": self._made_from_scalars()} if lowering == "shard_map" else {}
            self._jitted[lowering] = partir.lower(self.partitioning, self.jax_mesh, backend=lowering,
                                                  donate_argnums=self.donate_argnums, **options)
        return self._jitted[lowering]

    def _made_from_scalars(self):
        # What the cost model makes wherever it is read instead of moving it.
        import search

        return search.materialization(self.program).from_scalars

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
        """Save a picture: the search's best cost over time, how every parameter is split
        over the mesh axes, and each pipeline's schedule as a timeline per stage. The
        extension says the format (one matplotlib writes; none: PNG)."""
        path = picture_path(path, "plot path")
        with Writes() as writes:
            stage_plot(writes, self.to_json(), path, self.timings())
            writes.commit()

    # -- saving -----------------------------------------------------------------------
    def to_json(self) -> dict:
        """The versioned, human-readable description that `save` writes. It holds no
        figure of the machine that planned (timings are in `timings()`), so the same
        program, mesh, schedule, device and seed give the same file, unless the search
        was stopped by its time budget (then `search.reproducible` is false)."""
        import search

        prog, part = self.program, self.partitioning

        def entry(v, name):
            val = prog.values[v]
            return {"name": name, "shape": list(val.shape), "dtype": dtype_text(val.dtype),
                    "spec": part.tiling(v).to_json()}

        device = search.get_device(self.device)
        out = {
            "format": FORMAT, "version": VERSION, "automap_version": __version__,
            "key": self.key, "made_for": self.made_for, "lowering": self.lowering,
            "mesh": dict(self.mesh.axes),
            "device": self.device if isinstance(self.device, str) else device.name,
            "device_spec": device.to_dict(),
            "memory_limit": self.memory_limit,
            "donate_argnums": list(self.donate_argnums),
            "schedule": list(self.schedule_text),
            "inputs": [entry(v, n) for v, n in zip(prog.inputs, prog.input_names)],
            "outputs": [entry(v, n) if v >= 0 else {"name": n, "spec": []}
                        for v, n in zip(prog.outputs, prog.output_names)],
            "decisions": [d.to_json(prog) for d in part.decisions],
            "cost": _cost_json(self.cost),
        }
        if part.detached:  # (ZeRO below stage 3: its decisions replay only on values detached so)
            out["detached"] = [prog.name(v) for v in sorted(part.detached)]
        if part.pipelines:
            out["pipelines"] = [p.to_json(prog) for p in part.pipelines]
        if self.search is not None:
            result, groups = self.search, self.search.groups
            timed = result.stats.stopped == "time budget"
            out["search"] = {"stopped": result.stats.stopped, "reproducible": not timed,
                             "root_step_time_s": result.root_step_time,
                             "actions": [a.describe(groups) for a in result.actions]}
            if timed:
                out["search"]["note"] = ("stopped by its time budget: another run may search more or fewer "
                                         "episodes and make another plan; set max_episodes for a plan that "
                                         "does not depend on the machine")
        return out

    def timings(self) -> dict | None:
        """How the search ran on this machine (None when no search ran): episodes,
        states, cache hits, wall time and the best step time over time, `trace` as
        `[seconds, episode, step time]` rows. Not part of the plan file: `save(path,
        timings=True)` writes it beside it (`timing_path`)."""
        if self.search is None:
            return None
        st = self.search.stats
        return {"format": FORMAT + "-timing", "version": 1, "key": self.key, "episodes": st.episodes,
                "states": st.states, "cache_hits": st.cache_hits, "elapsed_s": st.elapsed,
                "trace": [list(t) for t in st.trace]}

    def save(self, path, *, timings: bool = False) -> None:
        """Write the plan as JSON (see `to_json`); with `timings`, also the search's
        timings to `timing_path(path)` (when a search ran). The folder must exist. Both
        or neither are written, each whole (see `Writes`: a link is written through, a
        FIFO or device in place)."""
        with Writes() as writes:
            self.stage(writes, path, timings=timings)
            writes.commit()

    def stage(self, writes, path, *, timings: bool = False) -> None:
        """`save` into `writes` (a `Writes`): the files are put in place when it commits,
        with the others it holds. The paths are checked first."""
        path = output_path(path, "plan path")
        timed = self.timings() if timings else None
        timing = output_path(timing_path(path), "timing path") if timed is not None else None
        writes.add(path, _json_file(self.to_json()))
        if timing is not None:
            writes.add(timing, _json_file(timed))

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


def _cost_json(c) -> dict:
    out = {"step_time_s": c.step_time, "step_time_overlap_s": c.step_time_overlap,
           "compute_time_s": c.compute_time, "comm_time_s": c.comm_time, "flops": c.flops,
           "memory_peak_bytes": c.memory_peak, "fits": c.fits,
           "collectives_by_axis": {",".join(k) or "-": {"count": n, "bytes": b, "time_s": t}
                                   for k, (n, b, t) in c.by_axis().items()}}
    if c.pipeline_ticks:  # one per entry of the file's "pipelines", in their order (the timeline's tick lengths)
        out["pipelines"] = [{"forward_tick_s": t.forward, "backward_tick_s": t.backward} for t in c.pipeline_ticks]
    return out


def dtype_text(dtype) -> str:
    """A dtype as plan files write it ('float32', 'bfloat16', 'key<fry>')."""
    try:
        return str(np.dtype(dtype))
    except TypeError:
        return str(dtype)


def timing_path(path) -> Path:
    """Where `Plan.save(path, timings=True)` writes the search's timings: beside the
    plan, `plan.json` -> `plan.timing.json`."""
    p = Path(path)
    return p.with_name(p.stem + ".timing.json")


def _json_file(data: dict):
    """A `Writes.add` writer of `data` as a plan file's JSON."""
    return lambda path: Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def stage_plot(writes, data: dict, path: Path, timings: dict | None) -> None:
    """Draw plan file content `data` (see `_plot.plot`) to `path` (checked by
    `picture_path`) when `writes` commits. matplotlib takes the format from the
    extension, which the temporary file keeps (PNG when there is none)."""
    from ._plot import plot

    writes.add(path, lambda tmp: plot(data, tmp, timings), suffix=Path(path).suffix or ".png")


class Writes:
    """Files written all or none, each whole. `add(path, write)` has `write(file)` write
    one to a temporary file beside `path`, named uniquely per call (threads and
    processes may save the same path at once); `commit()` renames them all into place,
    with Ctrl-C ignored while it does (renames take microseconds: an interrupt then
    would leave some outputs new and some old); leaving the `with` block without
    committing (an error, Ctrl-C) removes the temporary files, so nothing is written.
    A reader (another process sharing a plan cache) never sees half a file.

    A symbolic link is written through: its target is replaced, the link kept. A FIFO
    or a device (`/dev/null`, `/dev/stdout`) is written in place (a rename would put a
    regular file in its stead, and as root replace `/dev/null`), at the start of
    `commit`; a stream cannot be taken back, so Ctrl-C while it is written may leave it
    part of a file, and no other output."""

    def __init__(self):
        self._staged: list[tuple[Path, Path]] = []  # (temporary file, where it goes)
        self._streams: list[tuple[Path, object]] = []  # (FIFO or device, its writer)

    def __enter__(self) -> "Writes":
        return self

    def __exit__(self, *exc) -> None:
        for tmp, _ in self._staged:
            tmp.unlink(missing_ok=True)
        self._staged = []

    def add(self, path, write, *, suffix: str = "") -> None:
        """Write `path` with `write(file)`: to a temporary file ending in `suffix` now,
        put in place by `commit`; a FIFO or device is kept for `commit` to write."""
        path = Path(path)
        if _special(path):
            self._streams.append((path, write))
            return
        target = Path(os.path.realpath(path)) if path.is_symlink() else path
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp{suffix}")
        self._staged.append((tmp, target))  # first: a write cut short is removed too
        write(tmp)

    def commit(self, then=None) -> None:
        """Write the FIFOs and devices, then rename every file into place and call
        `then()` (e.g. keep the plan in a cache), Ctrl-C ignored meanwhile."""
        for path, write in self._streams:
            write(path)
        self._streams = []
        with _interrupts_ignored():
            for tmp, target in self._staged:
                os.replace(tmp, target)
            self._staged = []
            if then is not None:
                then()


def _special(path: Path) -> bool:
    """Is `path` (through links) a FIFO, device or socket: something a rename must not replace?"""
    try:
        return not stat.S_ISREG(path.stat().st_mode)
    except OSError:  # nothing there yet: a new regular file
        return False


@contextlib.contextmanager
def _interrupts_ignored():
    # Only the main thread may set signal handlers; another thread gets no Ctrl-C.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.SIG_DFL)
