"""`automap.partition` and `automap.jit`: plan a train step, cache the plan, run it."""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import jax

import partir
import tactics

from ._args import Options, options, with_settings_signature
from ._cache import PlanCache, key_of, key_parts, static_identity
from ._errors import AutomapError, MemoryLimitError, PlanCacheWarning
from ._plan import Plan

#: Where plans are cached between runs, unless `cache_dir=` or AUTOMAP_CACHE_DIR says.
DEFAULT_CACHE = Path.home() / ".cache" / "automap"


def lift(fn, args, opts: Options):
    """`fn(*args)` lifted, its unrolled layers rolled into layer scans where the schedule
    of `opts` pipelines (`rolled_for`)."""
    prog = partir.lift(fn, *args, static_argnums=opts.static_argnums)
    return rolled_for(prog, opts.tactics(), lenient=opts.best_effort)


def rolled_for(prog, schedule, *, lenient: bool = False):
    """`prog` with its unrolled layers rolled into layer scans (`partir.roll_layers`) when
    `schedule` pipelines (a `Pipeline`, or a search offering pipelines) and `prog` has
    no layer scan but a sequence of alike layers; else `prog`. Where the layers do not
    roll, a `Pipeline` in the schedule raises the reason (`TacticError`) unless
    `lenient` (it is then skipped as a tactic that cannot apply), and a search offers no
    pipeline."""
    import search

    explicit = any(isinstance(t, tactics.Pipeline) for t in schedule)
    offered = any(isinstance(t, search.AutomaticPartition) and t.pipelines for t in schedule)
    if not (explicit or offered) or partir.layer_scans(prog) or not partir.input_layers(prog):
        return prog
    try:
        return partir.roll_layers(prog)
    except partir.PartitioningError as e:
        if explicit and not lenient:
            raise tactics.TacticError(f"cannot pipeline the unrolled layers: {e}") from e
        return prog


def plan_program(prog, opts: Options, *, key: str = "", made_for: dict | None = None) -> Plan:
    """Apply the schedule of `opts` to a lifted program and wrap the result in a `Plan`
    (with `opts.best_effort`, a tactic that cannot apply is skipped, as the history
    says)."""
    schedule = opts.tactics()
    res = tactics.apply_schedule(prog, opts.mesh, schedule, best_effort=opts.best_effort)
    search_result = res.context.search[0] if res.context.search else None
    return Plan(res.partitioning, history=res.history, search=search_result, device=opts.device,
                memory_limit=opts.memory_limit, donate_argnums=opts.donated(),
                schedule_text=[str(t) for t in schedule], jax_mesh=opts.jax_mesh, key=key, made_for=made_for,
                lowering=opts.lowering)


def overflow(cost) -> str:
    """What a plan over its memory limit needs: its peak, the limit and the largest
    buffers live at the peak."""
    import search

    live = sorted(cost.memory_at_peak, key=lambda x: -x[1])[:3]
    return (f"the best plan found peaks at {search.bytes_str(cost.memory_peak)} per device, over the limit of "
            f"{search.bytes_str(cost.memory_limit)} (live at the peak: "
            + (", ".join(f"{n} {search.bytes_str(b)}" for n, b in live) or "nothing") + ")")


def check_fits(plan: Plan, best_effort: bool) -> Plan:
    """`plan`, unless it does not fit its memory limit and `best_effort` is False: then
    a `MemoryLimitError` with the peak, the limit, what is live at the peak and the fix."""
    c = plan.cost
    if c.fits or best_effort:
        return plan
    import search

    live = tuple(sorted(c.memory_at_peak, key=lambda x: -x[1])[:3])
    least = plan.search.stats.min_peak if plan.search is not None else float("inf")
    reached = f"; the smallest peak the search reached was {search.bytes_str(least)}" if least < float("inf") else ""
    remat = "" if plan.search is not None else ", rematerialization (tactics.Remat) in the schedule"
    raise MemoryLimitError(f"no plan fits the memory limit: {overflow(c)}{reached}; use a larger mesh, a larger "
                           f"memory_limit{remat}, or pass best_effort=True to take this plan", peak=c.memory_peak, limit=c.memory_limit,
                           live=live, plan=plan)


def _callable(fn, where: str):
    if not callable(fn):
        raise AutomapError(f"{where} got {fn!r}, which is not callable: pass the train step function")


@with_settings_signature
def partition(fn, **settings):
    """`partition(fn, mesh=...)(*args)` returns a `Plan` for `fn(*args)` without running it.

    `settings` are `Options`' (`mesh` required): `schedule` is a list of tactics
    (default: automatic search over all mesh axes within `budget_s` seconds, for
    `device`, under `memory_limit` bytes per device). `args` may be arrays,
    `jax.ShapeDtypeStruct`s or Python numbers. A plan over the memory limit raises
    `MemoryLimitError` unless `best_effort=True` (which also skips a tactic that cannot
    apply instead of raising). `lowering` is how the plan runs by default (`Plan.jit`;
    see `automap.LOWERINGS`). Settings are checked here, before any work.
    """
    _callable(fn, "automap.partition")
    opts = options(**settings)

    def make(*args, **kwargs) -> Plan:
        opts.check_call(args, kwargs, fn)
        prog = lift(fn, args, opts)
        parts = key_parts(prog, opts, opts.static(args))
        return check_fits(plan_program(prog, opts, key=key_of(parts), made_for=parts), opts.best_effort)

    return make


def cache_folder(cache_dir, what: str = "cache_dir") -> Path | None:
    """The plan cache folder: `cache_dir`, else $AUTOMAP_CACHE_DIR, else ~/.cache/automap
    (`~` expanded). `what` names the setting in errors. A `cache_dir` that is a file is an
    error; $AUTOMAP_CACHE_DIR naming a file, set outside the program, warns once and
    gives None: plans are made and run uncached."""
    if cache_dir is None:
        env = os.environ.get("AUTOMAP_CACHE_DIR")
        if not env:
            return DEFAULT_CACHE
        folder = Path(env).expanduser()
        if folder.exists() and not folder.is_dir():
            warnings.warn(f"AUTOMAP_CACHE_DIR={env!r} is a file, not a folder: plans are made and run uncached; "
                          "point it at a folder for the plans", PlanCacheWarning, stacklevel=3)
            return None
        return folder
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise AutomapError(f"{what} {cache_dir!r} is not a path: give a folder path or None")
    folder = Path(cache_dir).expanduser()
    if folder.exists() and not folder.is_dir():
        raise AutomapError(f"{what} {str(cache_dir)!r} is a file, not a folder: give a folder for the plans")
    return folder


def _leaf_signature(x):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False))
    return type(x).__name__  # a Python number (traced like jax.jit's), or refused by check_call


class AutomapFunction:
    """What `automap.jit` returns: call it like `jax.jit(fn)`. The first call with a new
    argument signature plans (or finds the plan in memory or in the cache directory),
    lowers (as `lowering` says) and compiles; later calls reuse the compiled plan. `stats` counts plans made,
    memory hits and disk hits; `plans` holds the plans by signature."""

    def __init__(self, fn, opts: Options, *, cache_dir=None, replan=False):
        _callable(fn, "automap.jit")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = opts
        if not isinstance(replan, bool):
            raise AutomapError(f"replan={replan!r} is not a bool: give True or False")
        self.cache = PlanCache(cache_folder(cache_dir))
        self.replan = replan
        self.plans: dict = {}
        self.stats = {"planned": 0, "memory_hits": 0, "disk_hits": 0}

    def _signature(self, args):
        dyn = self.options.dynamic(args)
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        # Static arguments by type and value, as jax.jit keys them: f(x, 1) and f(x, 1.0)
        # compare equal but trace different programs.
        # and compared with `==` (an object without a repr of its value is itself).
        static = self.options.static(args)
        return tree, tuple(_leaf_signature(x) for x in leaves), static, json.dumps(static_identity(static))

    def plan_for(self, *args) -> Plan:
        """The plan for these arguments (planning, or from a cache)."""
        opts = self.options
        try:
            sig = self._signature(args)
            plan = self.plans.get(sig)
        except TypeError:  # an unhashable static argument
            opts.check_call(args, {}, self.fn)
            raise
        if plan is not None:
            self.stats["memory_hits"] += 1
            return plan
        opts.check_call(args, {}, self.fn)
        n = len(jax.devices())
        if opts.jax_mesh is None and opts.mesh.num_devices > n:
            raise AutomapError(f"mesh {opts.mesh} needs {opts.mesh.num_devices} devices, {n} are available: use a "
                               "smaller mesh (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N)")
        prog = lift(self.fn, args, opts)
        parts = key_parts(prog, opts, opts.static(args))
        key = key_of(parts)
        plan = None if self.replan else self.cache.load(key, prog, opts.jax_mesh, made_for=parts)
        fresh = plan is None
        if fresh:
            plan = plan_program(prog, opts, key=key, made_for=parts)
        self.stats["planned" if fresh else "disk_hits"] += 1
        check_fits(plan, opts.best_effort)  # before anything is kept: an error leaves no trace
        if fresh:
            self.cache.store(plan)
        self.plans[sig] = plan
        return plan

    def __call__(self, *args, **kwargs):
        if kwargs:
            self.options.check_call(args, kwargs, self.fn)
        plan = self.plan_for(*args)
        dyn = self.options.dynamic(args)
        fn = plan.jit(self.options.lowering)
        try:
            return fn(*dyn)
        except ValueError:
            # An argument committed to other devices or another layout (jax.jit refuses
            # it): put it where the plan wants it, as `Plan.shard_args` does.
            moved = _placed(dyn, plan.in_shardings)
            if moved is None:
                raise
            return fn(*moved)

    def lower(self, *args):
        """`jax.jit(...).lower(...)` of the plan for these arguments."""
        return self.plan_for(*args).jit(self.options.lowering).lower(*self.options.dynamic(args))


def _placed(dyn, shardings):
    """`dyn` with every array whose sharding is not the plan's moved there; None when
    all already are."""
    leaves, tree = jax.tree_util.tree_flatten(dyn)
    targets = jax.tree_util.tree_leaves(shardings)
    if len(leaves) != len(targets):
        return None
    wrong = [isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, targets)]
    if not any(wrong):
        return None
    moved = [jax.device_put(x, s) if w else x for x, s, w in zip(leaves, targets, wrong)]
    return jax.tree_util.tree_unflatten(tree, moved)


@with_settings_signature
def jit(fn=None, *, cache_dir=None, replan=False, **settings):
    """Partition a train step automatically and run it, as `jax.jit` would.

    Usable as `automap.jit(step, mesh=mesh)` or `@automap.jit(mesh=mesh)`; `settings` are
    `Options`' (`mesh` required). The first call with a new signature lifts `fn`, plans it
    (default schedule: automatic search over all mesh axes for `device`, within
    `budget_s`), lowers and runs it; the plan is cached in memory and on disk under
    `cache_dir` (default ~/.cache/automap, or AUTOMAP_CACHE_DIR), keyed by everything that
    can change it (`automap._cache.key_parts`), so a restarted job does not search again;
    `replan=True` forces a new plan. Python numbers among the arguments are traced as
    `jax.jit` traces them; other non-array leaves go in `static_argnums`. A plan over the
    memory limit raises `MemoryLimitError` unless `best_effort=True`. Outputs are sharded
    `jax.Array`s that can be fed back in without resharding. `lowering` chooses how the
    plan runs: 'jit' (XLA inserts the collectives the shardings imply) or 'shard_map'
    (each device's program, with exactly the collectives the cost model lists); see the
    README. Settings are checked here, before any work.
    """
    opts = options(**settings)  # fail at decoration
    if fn is None:
        return lambda f: AutomapFunction(f, opts, cache_dir=cache_dir, replan=replan)
    return AutomapFunction(fn, opts, cache_dir=cache_dir, replan=replan)
