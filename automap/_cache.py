"""The plan cache: plans on disk, one JSON file per key, the key made from everything
that can change a plan (`key_parts`), and each entry checked against what its key was
made from when it is read."""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path

import jax

from ._version import __version__
from ._errors import AutomapError, PlanCacheWarning, PlanError

#: Object addresses in reprs and jaxprs (`<function f at 0x7f...>`): they differ between
#: processes, so they are left out of every identity.
_ADDRESS = re.compile(r"0x[0-9a-f]+")


def program_hash(program) -> str:
    """The program's identity: its jaxpr (object addresses left out: they differ
    between processes) and its inputs' and outputs' names (pytree paths, which the
    jaxpr does not show)."""
    text = _ADDRESS.sub("0x", str(program.closed_jaxpr))
    h = hashlib.sha256(text.encode())
    h.update(json.dumps([list(program.input_names), list(program.output_names)]).encode())
    return h.hexdigest()


def static_identity(value):
    """A static argument as JSON data that tells apart what `==` does not: `1`, `1.0` and
    `True` compare equal but trace different programs, so the type is part of it (inside
    tuples and lists too), as `jax.jit` keys static arguments by type and value."""
    if isinstance(value, (tuple, list)):
        return [type(value).__qualname__, [static_identity(v) for v in value]]
    return [f"{type(value).__module__}.{type(value).__qualname__}", _ADDRESS.sub("0x", repr(value))]


def key_parts(program, options, static_args=()) -> dict:
    """Everything that can change the plan for `program` under `options` (an
    `automap._args.Options`), as JSON data: the program, the static arguments it was
    traced with (type and value), the mesh, every tactic's identity (all its settings),
    the device's description (its figures, not its name), the memory limit, whether a
    tactic may be skipped (`best_effort`), the donated arguments, the lowering, and the
    JAX and automap versions."""
    import search

    return {"program": program_hash(program), "static": [static_identity(a) for a in static_args],
            "mesh": [list(a) for a in options.mesh.axes],
            "schedule": [t.identity() for t in options.tactics()],
            "device": search.get_device(options.device).to_dict(), "memory_limit": options.memory_limit,
            "best_effort": options.best_effort, "donate_argnums": list(options.donated()),
            "lowering": options.lowering, "jax": jax.__version__, "automap": __version__}


def key_of(parts: dict) -> str:
    """The cache key: a hash of `key_parts`, serialised canonically."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class PlanCache:
    """Plans on disk under `folder`, as `<key>.json`.

    An entry that cannot be read, was made from other parts than its key's (copied or
    edited under another name), or does not fit its program is set aside (renamed
    `<key>.json.broken`, with a `PlanCacheWarning`) so that the plan is made again. A
    folder that cannot be made or written (read-only, a file in its place) only costs a
    search: one `PlanCacheWarning`, then plans are made and run uncached."""

    def __init__(self, folder: Path | None):
        self.folder = None if folder is None else Path(folder)
        self._warned = False

    def path(self, key: str) -> Path:
        """Where the plan for `key` is kept."""
        return self.folder / f"{key}.json"

    def load(self, key: str, program, jax_mesh=None, made_for: dict | None = None):
        """The cached plan for `key`, bound to `program`, or None. With `made_for` (the
        parts the key was made from), an entry made from other parts is set aside."""
        from ._planfile import load_plan

        if self.folder is None:
            return None
        path = self.path(key)
        if not path.exists():
            return None
        try:
            saved = load_plan(path)
            if made_for is not None and saved.data.get("made_for") != _as_json(made_for):
                raise PlanError(f"it was made for other settings than its key's ({_first_difference(saved.data.get('made_for'), made_for)})")
            return saved.bind_program(program, jax_mesh)
        except PlanError as e:
            self._set_aside(path, str(e).splitlines()[0])
            return None

    def _set_aside(self, path: Path, why: str) -> None:
        aside = path.with_name(path.name + ".broken")
        try:
            os.replace(path, aside)
            where = f"moved it to {aside}"
        except OSError as e:
            where = f"could not move it ({e})"
        warnings.warn(f"plan cache entry {path} cannot be used ({why}); {where} and planning again",
                      PlanCacheWarning, stacklevel=4)

    def store(self, plan) -> None:
        """Keep `plan` under its key; a folder that cannot be written warns once and
        leaves the plan uncached."""
        if self.folder is None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not os.access(self.folder, os.W_OK):
                raise PermissionError(f"folder {self.folder} is not writable")
            plan.save(self.path(plan.key))
        except (OSError, AutomapError) as e:  # AutomapError: the plan path is a folder
            self.unusable(str(e).splitlines()[0])

    def unusable(self, why: str) -> None:
        """Warn, once per cache, that plans will not be kept (`why`), and stop using it."""
        if not self._warned:
            warnings.warn(f"plan cache {self.folder} cannot be written ({why}): plans are made and run uncached, "
                          "so a restarted job searches again; give a writable cache_dir (or AUTOMAP_CACHE_DIR)",
                          PlanCacheWarning, stacklevel=4)
        self._warned = True
        self.folder = None


def _as_json(data):
    """`data` as it reads back from a JSON file (tuples become lists)."""
    return json.loads(json.dumps(data))


def _first_difference(stored, made_for: dict) -> str:
    if not isinstance(stored, dict):
        return "the entry records none"
    made_for = _as_json(made_for)
    for k in sorted(set(stored) | set(made_for)):
        if stored.get(k) != made_for.get(k):
            return f"{k!r} differs"
    return "they differ"
