"""automap's arguments, checked before any work starts: `Options` holds the checked
settings of `partition`/`jit`; `Options.check_call` checks the arguments of one call;
`output_path` a file to write."""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

import tactics
from partir import MeshSpec, PartitioningError, lowering_mesh
from search import DEFAULT_DEVICE
from tactics import check

from ._errors import AutomapError

#: How a plan runs (`partir.lower`'s backends): `jax.jit` with the plan's shardings, XLA's
#: partitioner inserting the collectives ('jit'), or the per-device program with exactly
#: the modeled collectives under `jax.shard_map` ('shard_map').
LOWERINGS = ("jit", "shard_map")


def check_lowering(lowering, error=AutomapError) -> str:
    """`lowering` if it is one of `LOWERINGS`, else `error` listing them."""
    if lowering not in LOWERINGS:
        raise error(f"lowering={lowering!r} is not one of {', '.join(map(repr, LOWERINGS))}: 'jit' lets XLA place "
                    "the collectives, 'shard_map' runs exactly the modeled ones")
    return lowering


@dataclass(frozen=True)
class Options:
    """Every setting of `automap.partition` and `automap.jit`, with its default: the one
    source of them (the functions take these keywords, the plan cache keys on them, the
    CLI's flags default to them). Checked and normalised when made (`__post_init__`):
    a wrong one raises `AutomapError` (or the device's `search.DeviceError`) naming the
    setting, the problem and the fix.

    - `mesh`: a `jax.sharding.Mesh` (Auto or Explicit axes), a `partir.MeshSpec`, a dict
      or 'data=2,model=4'; kept as a `MeshSpec`, the jax mesh (if given) as `jax_mesh`;
    - `schedule`: a list of tactics, or None for the automatic search over all axes;
    - `device`: the cost model's device (a preset name, a `DeviceSpec` or a file);
    - `memory_limit`: bytes per device (None: the device's HBM);
    - `static_argnums`, `donate_argnums`: as for `jax.jit`;
    - `budget_s`, `seed`: the automatic search's time budget and seed;
    - `best_effort`: take a plan over the memory limit, skip a tactic that cannot apply;
    - `lowering`: how the plan runs, one of `LOWERINGS`;
    - `grad_accum`: how many micro-batches a step the program (the step of one) runs with
      gradient accumulation; the search chooses by the accumulated step (see
      `search.AutomaticPartition`), and fills it into a searching schedule that left it 1.
    """

    mesh: object
    schedule: object = None
    device: object = DEFAULT_DEVICE
    memory_limit: object = None
    static_argnums: object = ()
    donate_argnums: object = ()
    budget_s: object = 30.0
    seed: object = 0
    best_effort: object = False
    lowering: object = "jit"
    grad_accum: object = 1
    jax_mesh: Mesh | None = dataclasses.field(default=None, init=False, compare=False)

    def __post_init__(self):
        import search

        def put(name, value):
            object.__setattr__(self, name, value)

        mesh_spec, jax_mesh = mesh_of(self.mesh)
        put("mesh", mesh_spec), put("jax_mesh", jax_mesh)
        search.get_device(self.device)
        static, donate = argnums("static_argnums", self.static_argnums), argnums("donate_argnums", self.donate_argnums)
        both = sorted(set(static) & set(donate))
        if both:
            raise AutomapError(f"argument {both[0]} is in both static_argnums and donate_argnums: a static argument "
                               "is no buffer to donate; drop it from one")
        put("static_argnums", static), put("donate_argnums", donate)
        if not isinstance(self.best_effort, bool):
            raise AutomapError(f"best_effort={self.best_effort!r} is not a bool: give True or False")
        check_lowering(self.lowering)
        put("schedule", schedule_of(self.schedule, mesh_spec))
        _check_rings(self.schedule, self.lowering)
        put("memory_limit", check.number("memory_limit", self.memory_limit, optional=True, error=AutomapError,
                                         example="memory_limit=80e9 (bytes per device)"))
        put("budget_s", check.number("budget_s", self.budget_s, example="budget_s=30", error=AutomapError))
        put("seed", check.number("seed", self.seed, integer=True, sign="any", example="seed=0", error=AutomapError))
        put("grad_accum", check.number("grad_accum", self.grad_accum, integer=True, error=AutomapError,
                                       example="grad_accum=32 (micro-batches a step)"))

    @classmethod
    def default(cls, name: str):
        """The default of setting `name`."""
        return next(f.default for f in dataclasses.fields(cls) if f.name == name)

    def tactics(self) -> list:
        """The schedule to apply: the one given, or the automatic search."""
        import search

        if self.schedule is not None:
            # A search that leaves its lowering open prices the one this plan runs under,
            # one left at a micro-batch a step prices this plan's accumulation, one left
            # without donation, a device or a limit prices this plan's (its peak is the
            # one the plan runs at, on the device it is priced on).
            return [self._filled(t) if isinstance(t, search.AutomaticPartition) else t for t in self.schedule]
        # The search returns its best plan even over the limit: whether a plan may be
        # over it is this layer's verdict (`MemoryLimitError` unless best_effort).
        return [search.AutomaticPartition(budget_s=self.budget_s, seed=self.seed, device=self.device,
                                          memory_limit=self.memory_limit, best_effort=True, lowering=self.lowering,
                                          grad_accum=self.grad_accum, donate_argnums=self.donated())]

    def _filled(self, auto):
        """Search `auto` with the settings it left open taken from these options."""
        return dataclasses.replace(auto, lowering=self.lowering if auto.lowering is None else auto.lowering,
                                   grad_accum=self.grad_accum if auto.grad_accum == 1 else auto.grad_accum,
                                   donate_argnums=auto.donate_argnums or self.donated(),
                                   device=self.device if auto.device is None else auto.device,
                                   memory_limit=self.memory_limit if auto.memory_limit is None else auto.memory_limit)

    def donated(self) -> tuple[int, ...]:
        """`donate_argnums` as positions among the non-static arguments (what the lowered
        plan is called with)."""
        return tuple(i - sum(s < i for s in self.static_argnums) for i in self.donate_argnums)

    def static(self, args) -> tuple:
        """The static arguments, in order."""
        return tuple(a for i, a in enumerate(args) if i in self.static_argnums)

    def dynamic(self, args) -> tuple:
        """The non-static arguments."""
        return tuple(a for i, a in enumerate(args) if i not in self.static_argnums)

    def check_call(self, args, kwargs, fn) -> None:
        """Arguments `fn` can be planned for: positional only, argnums in range,
        hashable static arguments, arrays or Python numbers elsewhere."""
        name = getattr(fn, "__name__", "the function")
        if kwargs:
            raise AutomapError(f"{name} was called with keyword argument(s) {', '.join(kwargs)}: automap plans "
                               "positional arguments only; pass them positionally, or bind them with "
                               "functools.partial before automap")
        for what, nums in (("static_argnums", self.static_argnums), ("donate_argnums", self.donate_argnums)):
            bad = [i for i in nums if i >= len(args)]
            if bad:
                raise AutomapError(f"{what}={nums} names argument {bad[0]}, but {name} got {len(args)} "
                                   f"argument(s): give positions 0 to {len(args) - 1}")
        for i in self.static_argnums:
            try:
                hash(args[i])
            except TypeError:
                raise AutomapError(f"static argument {i} of {name} is a {type(args[i]).__name__}, which is not "
                                   "hashable: pass a tuple (or another hashable value), or drop it from "
                                   "static_argnums") from None
        for i, a in enumerate(args):
            if i not in self.static_argnums:
                _check_leaves(name, i, a)


def _check_leaves(name: str, i: int, arg) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) and not isinstance(leaf, numbers.Number):
            where = f"argument {i}{jax.tree_util.keystr(path)}"
            raise AutomapError(f"{where} of {name} is a {type(leaf).__name__} ({leaf!r:.40}), not an array or a "
                               f"number: pass the argument in static_argnums=({i},) (it must be hashable), or "
                               "make the leaf an array")


#: The settings a user gives (`Options`' fields but the derived `jax_mesh`).
SETTINGS = tuple(f.name for f in dataclasses.fields(Options) if f.init)


def options(**settings) -> Options:
    """`Options(**settings)`, an unknown setting named in an `AutomapError` that lists
    them all."""
    unknown = [k for k in settings if k not in SETTINGS]
    if unknown:
        raise AutomapError(f"unknown setting {unknown[0]!r}: automap takes {', '.join(SETTINGS)}")
    if "mesh" not in settings:
        raise AutomapError("mesh is missing: give mesh=, e.g. mesh='data=2,model=4' or a jax.sharding.Mesh")
    return Options(**settings)


def mesh_of(mesh) -> tuple[MeshSpec, Mesh | None]:
    """(MeshSpec, jax Mesh or None) from a jax Mesh, a MeshSpec, a dict or 'data=2,model=4'."""
    if isinstance(mesh, Mesh):
        try:
            lowering_mesh(mesh)  # Manual axes cannot be planned over
        except PartitioningError as e:
            raise AutomapError(f"mesh={mesh}: {e}") from None
        return MeshSpec.from_jax(mesh), mesh
    if isinstance(mesh, MeshSpec):
        return mesh, None
    try:
        if isinstance(mesh, str):
            return MeshSpec.parse(mesh), None  # its errors quote the text
        if isinstance(mesh, dict):
            return MeshSpec.of(**mesh), None
    except PartitioningError as e:
        raise AutomapError(str(e) if isinstance(mesh, str) else f"mesh={mesh!r}: {e}") from None
    raise AutomapError(f"mesh={mesh!r}: pass a jax.sharding.Mesh, a partir.MeshSpec, a dict or 'data=2,model=4'")


def argnums(name: str, value) -> tuple[int, ...]:
    """An int or a sequence of distinct non-negative ints, as a tuple."""
    nums = (value,) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if isinstance(nums, (str, bytes)) or not isinstance(nums, (tuple, list, range)):
        raise AutomapError(f"{name}={value!r}: give an argument position or a tuple of them, e.g. {name}=(0,)")
    for i in nums:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
            raise AutomapError(f"{name}={value!r} holds {i!r}: argument positions are non-negative integers")
    if len(set(nums)) != len(nums):
        raise AutomapError(f"{name}={value!r} repeats a position: give each once")
    return tuple(int(i) for i in nums)


def _check_rings(schedule, lowering: str) -> None:
    """A ring (`ContextParallel(strategy='ring')`) runs under the shard_map lowering only
    (XLA's partitioner does not emit it from layouts): refused with 'jit' before any work."""
    if lowering != "jit" or schedule is None:
        return
    for i, t in enumerate(schedule):
        if isinstance(t, tactics.ContextParallel) and t.strategy == "ring":
            raise AutomapError(f"schedule[{i}] {t} moves keys and values round a ring, which only "
                               "lowering='shard_map' runs (the jit lowering's XLA partitioner does not emit it): "
                               "pass lowering='shard_map', or use strategy='allgather'")


def schedule_of(schedule, mesh: MeshSpec) -> tuple | None:
    """A list of tactics whose axes are the mesh's (None: the automatic search)."""
    if schedule is None:
        return None
    if isinstance(schedule, tactics.Tactic):
        raise AutomapError(f"schedule={schedule} is one tactic: pass a list, schedule=[{schedule}]")
    if not isinstance(schedule, (list, tuple)):
        raise AutomapError(f"schedule={schedule!r} is {check.a(type(schedule).__name__)}: pass a list of tactics, e.g. "
                           "[DataParallel('data'), Megatron('model')]")
    for i, t in enumerate(schedule):
        if isinstance(t, type) and issubclass(t, tactics.Tactic):
            raise AutomapError(f"schedule[{i}] is the class {t.__name__}, not a tactic: make one, e.g. "
                               f"{t.__name__}('data')")
        if not isinstance(t, tactics.Tactic):
            raise AutomapError(f"schedule[{i}]={t!r} is not a tactic: use {tactics.tactic_names()} or "
                               "search.AutomaticPartition")
        for axis in t.axes_named():
            if axis not in mesh.names:
                raise AutomapError(f"schedule[{i}] {t} names axis {axis!r}, which is not an axis of mesh {mesh}: "
                                   f"use one of {list(mesh.names)}")
    return tuple(schedule)


def output_path(path, what: str) -> Path:
    """`path` checked as a file that can be written: not a folder, in a folder that
    exists and is writable. `what` names it in the error (e.g. "plot path").

    A symbolic link is written through (its target replaced, the link kept), so the
    target's folder is the one checked; a FIFO or device (`/dev/null`, `/dev/stdout`) is
    written in place, so it must be writable itself (see `automap._plan.Writes`)."""
    if not isinstance(path, (str, os.PathLike)):
        raise AutomapError(f"{what} {path!r} is {check.a(type(path).__name__)}: give a file path")
    p = Path(path)
    try:
        mode = p.stat().st_mode  # through links
    except FileNotFoundError:
        mode = None  # a new file, or a link to one
    except OSError as e:  # a loop of links, a folder on the way that is a file, ...
        raise AutomapError(f"{what} {p} cannot be looked up ({e.strerror}): give another path") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise AutomapError(f"{what} {p} is a folder: give a file name, e.g. {p / 'plan.json'}")
    if mode is not None and not stat.S_ISREG(mode):
        if not os.access(p, os.W_OK):
            raise AutomapError(f"{what} {p} is a special file that is not writable; choose another path")
        return p
    folder = Path(os.path.realpath(p)).parent if p.is_symlink() else p.parent
    if not folder.is_dir():
        raise AutomapError(f"{what} {p}: folder {folder} does not exist; create it first (mkdir -p {folder})")
    if not os.access(folder, os.W_OK):
        raise AutomapError(f"{what} {p}: folder {folder} is not writable; choose another folder")
    return p


def picture_path(path, what: str) -> Path:
    """`output_path`, with an extension matplotlib can write (none: PNG)."""
    from matplotlib.backend_bases import FigureCanvasBase

    p = output_path(path, what)
    kinds = FigureCanvasBase.get_supported_filetypes()
    if p.suffix and p.suffix[1:].lower() not in kinds:
        raise AutomapError(f"{what} {p}: matplotlib does not write {p.suffix!r} pictures; end the name in one of "
                           f"{', '.join('.' + k for k in sorted(kinds))}")
    return p


def distinct_outputs(paths: dict) -> None:
    """`paths` ({what: path}, None for one not asked for) name different files: else the
    later would overwrite the earlier (a picture over the plan)."""
    seen: dict = {}
    for what, path in paths.items():
        if path is None:
            continue
        key = os.path.realpath(path)  # through links, relative or not
        for other, (other_key, other_path) in seen.items():
            if key == other_key or (os.path.exists(key) and os.path.exists(other_key)
                                    and os.path.samefile(key, other_key)):
                raise AutomapError(f"{what} {path} is the same file as {other} {other_path}: give each its own "
                                   "file name")
        seen[what] = (key, path)


def with_settings_signature(fn):
    """`fn` (which takes `**settings`) shown by `help()` and IDEs with `Options`' fields
    as its keyword arguments and their defaults."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                 default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)
               for f in dataclasses.fields(Options) if f.init]
    fn.__signature__ = sig.replace(parameters=params)
    return fn
