"""`automap.partition` and `automap.jit`: plan a train step, cache the plan, run it."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import jax
from jax.sharding import Mesh

import partir
import tactics
from partir import MeshSpec, PartitioningError

from ._plan import Plan, PlanError, check_lowering, fingerprint, load_plan

#: Where plans are cached between runs, unless `cache_dir=` or AUTOMAP_CACHE_DIR says.
DEFAULT_CACHE = Path.home() / ".cache" / "automap"


def _mesh(mesh):
    """(MeshSpec, jax Mesh or None) from a jax Mesh, a MeshSpec or 'data=2,model=4'."""
    if isinstance(mesh, Mesh):
        return MeshSpec.from_jax(mesh), mesh
    if isinstance(mesh, MeshSpec):
        return mesh, None
    if isinstance(mesh, str):
        return MeshSpec.parse(mesh), None
    if isinstance(mesh, dict):
        return MeshSpec.of(**mesh), None
    raise PartitioningError(f"mesh={mesh!r}: pass a jax.sharding.Mesh, a partir.MeshSpec, a dict or 'data=2,model=4'")


def _schedule(schedule, device, memory_limit, budget_s, seed):
    if schedule is None:
        import search

        return [search.AutomaticPartition(budget_s=budget_s, seed=seed, device=device, memory_limit=memory_limit)]
    return list(schedule)


def schedule_key(schedule) -> str:
    """The schedule's part of a plan's cache key: every tactic's identity (all the
    settings that make it the tactic it is), serialised canonically."""
    return json.dumps([t.identity() for t in schedule], sort_keys=True)


def _device_text(device) -> str:
    return device if isinstance(device, str) else repr(device)


def plan_program(prog, mesh_spec, schedule, *, device="h100", memory_limit=None, donate_argnums=(), jax_mesh=None,
                 key="", lowering="jit") -> Plan:
    """Apply `schedule` to a lifted program and wrap the result in a `Plan`."""
    res = tactics.apply_schedule(prog, mesh_spec, schedule)
    search_result = res.context.search[0] if res.context.search else None
    return Plan(res.partitioning, history=res.history, search=search_result, device=device,
                memory_limit=memory_limit, donate_argnums=donate_argnums,
                schedule_text=[str(t) for t in schedule], jax_mesh=jax_mesh, key=key, lowering=lowering)


def partition(fn, *, mesh, schedule=None, device="h100", memory_limit=None, static_argnums=(), donate_argnums=(),
              budget_s: float = 30.0, seed: int = 0, lowering: str = "jit"):
    """`partition(fn, mesh=...)(*args)` returns a `Plan` for `fn(*args)` without running it.

    `schedule` is a list of tactics (default: automatic search over all mesh axes within
    `budget_s` seconds, for `device`, under `memory_limit` bytes per device). `args` may
    be arrays or `jax.ShapeDtypeStruct`s. `lowering` is how the plan runs by default
    (`Plan.jit`; see `automap.LOWERINGS`).
    """
    check_lowering(lowering)
    mesh_spec, jax_mesh = _mesh(mesh)

    def make(*args) -> Plan:
        sched = _schedule(schedule, device, memory_limit, budget_s, seed)
        prog = partir.lift(fn, *args, static_argnums=static_argnums)
        key = fingerprint(prog, mesh_spec, schedule_key(sched), _device_text(device), str(memory_limit))
        return plan_program(prog, mesh_spec, sched, device=device, memory_limit=memory_limit,
                            donate_argnums=donate_argnums, jax_mesh=jax_mesh, key=key, lowering=lowering)

    return make


class AutomapFunction:
    """What `automap.jit` returns: call it like `jax.jit(fn)`. The first call with a new
    argument signature plans (or finds the plan in memory or in the cache directory),
    lowers (as `lowering` says) and compiles; later calls reuse the compiled plan. `stats`
    counts plans made, memory hits and disk hits; `plans` holds the plans by signature."""

    def __init__(self, fn, *, mesh, schedule=None, device="h100", memory_limit=None, static_argnums=(),
                 donate_argnums=(), cache_dir=None, replan=False, budget_s=30.0, seed=0, lowering="jit"):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.lowering = check_lowering(lowering)
        self.mesh_spec, self.jax_mesh = _mesh(mesh)
        self.schedule = schedule
        self.device = device
        self.memory_limit = memory_limit
        self.static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self.donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        env = os.environ.get("AUTOMAP_CACHE_DIR")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Path(env) if env else DEFAULT_CACHE
        self.replan = replan
        self.budget_s, self.seed = budget_s, seed
        self.plans: dict = {}
        self._compiled: dict = {}
        self.stats = {"planned": 0, "memory_hits": 0, "disk_hits": 0}

    def _signature(self, args):
        dyn = [a for i, a in enumerate(args) if i not in self.static_argnums]
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        static = tuple(a for i, a in enumerate(args) if i in self.static_argnums)
        return tree, tuple((tuple(x.shape), str(x.dtype)) for x in leaves), static

    def plan_for(self, *args) -> Plan:
        """The plan for these arguments (planning, or from a cache)."""
        sig = self._signature(args)
        plan = self.plans.get(sig)
        if plan is not None:
            self.stats["memory_hits"] += 1
            return plan
        sched = _schedule(self.schedule, self.device, self.memory_limit, self.budget_s, self.seed)
        prog = partir.lift(self.fn, *args, static_argnums=self.static_argnums)
        key = fingerprint(prog, self.mesh_spec, schedule_key(sched), _device_text(self.device),
                          f"{self.memory_limit}|{self.donate_argnums}")
        path = self.cache_dir / f"{key}.json"
        plan = None
        if path.exists() and not self.replan:
            try:
                plan = load_plan(path).bind_program(prog, jax_mesh=self.jax_mesh)
                plan.donate_argnums = self.donate_argnums
                plan.lowering = self.lowering
                self.stats["disk_hits"] += 1
            except PlanError:
                plan = None  # a stale or foreign file: plan again and overwrite it
        if plan is None:
            plan = plan_program(prog, self.mesh_spec, sched, device=self.device, memory_limit=self.memory_limit,
                                donate_argnums=self.donate_argnums, jax_mesh=self.jax_mesh, key=key,
                                lowering=self.lowering)
            self.stats["planned"] += 1
            try:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                plan.save(path)
            except OSError:
                pass  # a read-only cache directory only costs the next run a search
        self.plans[sig] = plan
        return plan

    def __call__(self, *args):
        plan = self.plan_for(*args)
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        return plan.jit(self.lowering)(*dyn)

    def lower(self, *args):
        """`jax.jit(...).lower(...)` of the plan for these arguments."""
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        return self.plan_for(*args).jit(self.lowering).lower(*dyn)


def jit(fn=None, *, mesh, schedule=None, device="h100", memory_limit=None, static_argnums=(), donate_argnums=(),
        cache_dir=None, replan=False, budget_s=30.0, seed=0, lowering="jit"):
    """Partition a train step automatically and run it, as `jax.jit` would.

    Usable as `automap.jit(step, mesh=mesh)` or `@automap.jit(mesh=mesh)`. The first call
    with a new signature lifts `fn`, plans it (default schedule: automatic search over all
    mesh axes for `device`, within `budget_s`), lowers and runs it; the plan is cached in
    memory and on disk under `cache_dir` (default ~/.cache/automap, or
    AUTOMAP_CACHE_DIR), keyed by the program, mesh, schedule, device and automap version,
    so a restarted job does not search again; `replan=True` forces a new plan. Outputs
    are sharded `jax.Array`s that can be fed back in without resharding. `lowering`
    chooses how the plan runs: 'jit' (XLA inserts the collectives the shardings imply)
    or 'shard_map' (each device's program, with exactly the collectives the cost model
    lists); see the README.
    """
    check_lowering(lowering)
    kwargs = dict(mesh=mesh, schedule=schedule, device=device, memory_limit=memory_limit,
                  static_argnums=static_argnums, donate_argnums=donate_argnums, cache_dir=cache_dir,
                  replan=replan, budget_s=budget_s, seed=seed, lowering=lowering)
    if fn is None:
        return lambda f: AutomapFunction(f, **kwargs)
    return AutomapFunction(fn, **kwargs)
