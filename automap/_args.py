"""automap's arguments, checked before any work starts: `Options` holds the checked
settings of `partition`/`jit`; `Options.check_call` checks the arguments of one call;
`output_path` a file to write."""

from __future__ import annotations

import dataclasses
import numbers
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

import tactics
from partir import MeshSpec, PartitioningError, lowering_mesh
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
    """The checked settings shared by `automap.partition` and `automap.jit`."""

    mesh: MeshSpec
    jax_mesh: Mesh | None
    schedule: tuple | None  # None: the automatic search over all mesh axes
    device: object
    memory_limit: float | None
    static_argnums: tuple[int, ...]
    donate_argnums: tuple[int, ...]
    budget_s: float
    seed: int
    best_effort: bool
    lowering: str = "jit"

    def tactics(self) -> list:
        """The schedule to apply: the one given, or the automatic search."""
        if self.schedule is not None:
            return list(self.schedule)
        import search

        # The search returns its best plan even over the limit: whether a plan may be
        # over it is this layer's verdict (`MemoryLimitError` unless best_effort).
        return [search.AutomaticPartition(budget_s=self.budget_s, seed=self.seed, device=self.device,
                                          memory_limit=self.memory_limit, best_effort=True)]

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


def options(*, mesh, schedule, device, memory_limit, static_argnums, donate_argnums, budget_s, seed,
            best_effort, lowering="jit") -> Options:
    """Check `partition`/`jit` settings; the first problem raises `AutomapError` (or the
    device's `search.DeviceError`)."""
    import search

    mesh_spec, jax_mesh = mesh_of(mesh)
    search.get_device(device)
    static, donate = argnums("static_argnums", static_argnums), argnums("donate_argnums", donate_argnums)
    both = sorted(set(static) & set(donate))
    if both:
        raise AutomapError(f"argument {both[0]} is in both static_argnums and donate_argnums: a static argument "
                           "is no buffer to donate; drop it from one")
    for flag, value in (("best_effort", best_effort),):
        if not isinstance(value, bool):
            raise AutomapError(f"{flag}={value!r} is not a bool: give True or False")
    check_lowering(lowering)
    return Options(mesh_spec, jax_mesh, schedule_of(schedule, mesh_spec), device,
                   check.number("memory_limit", memory_limit, optional=True, error=AutomapError,
                                example="memory_limit=80e9 (bytes per device)"),
                   static, donate,
                   check.number("budget_s", budget_s, example="budget_s=30", error=AutomapError),
                   check.number("seed", seed, integer=True, sign="any", example="seed=0", error=AutomapError),
                   best_effort, lowering)


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
            raise AutomapError(f"schedule[{i}]={t!r} is not a tactic: use Shard, DataParallel, Megatron, ZeRO, "
                               "FSDP, SequenceParallel, ExpertParallel or search.AutomaticPartition")
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
