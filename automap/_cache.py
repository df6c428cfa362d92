"""The plan cache: plans on disk, one JSON file per key, the key made from everything
that can change a plan (`key_parts`)."""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path

import jax

from . import __version__
from ._errors import PlanCacheWarning, PlanError


def program_hash(program) -> str:
    """The program's identity: its jaxpr (object addresses left out: they differ
    between processes) and its inputs' and outputs' names (pytree paths, which the
    jaxpr does not show)."""
    text = re.sub(r"0x[0-9a-f]+", "0x", str(program.closed_jaxpr))
    h = hashlib.sha256(text.encode())
    h.update(json.dumps([list(program.input_names), list(program.output_names)]).encode())
    return h.hexdigest()


def key_parts(program, options) -> dict:
    """Everything that can change the plan for `program` under `options` (an
    `automap._args.Options`), as JSON data: the program, the mesh, every tactic's
    identity (all its settings), the device's description (its figures, not its name),
    the memory limit, the donated arguments, the lowering, and the JAX and automap
    versions."""
    import search

    return {"program": program_hash(program), "mesh": [list(a) for a in options.mesh.axes],
            "schedule": [t.identity() for t in options.tactics()],
            "device": search.get_device(options.device).to_dict(), "memory_limit": options.memory_limit,
            "donate_argnums": list(options.donated()), "lowering": options.lowering,
            "jax": jax.__version__, "automap": __version__}


def key_of(parts: dict) -> str:
    """The cache key: a hash of `key_parts`, serialised canonically."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class PlanCache:
    """Plans on disk under `folder`, as `<key>.json`. An entry that cannot be read or
    does not fit its program is set aside (renamed `<key>.json.broken`, with a
    `PlanCacheWarning`) so that the plan is made again; a folder that cannot be written
    only costs the next run a search."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def path(self, key: str) -> Path:
        """Where the plan for `key` is kept."""
        return self.folder / f"{key}.json"

    def load(self, key: str, program, jax_mesh=None):
        """The cached plan for `key`, bound to `program`, or None."""
        from ._planfile import load_plan

        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return load_plan(path).bind_program(program, jax_mesh)
        except PlanError as e:
            self._set_aside(path, str(e).splitlines()[0])
            return None

    def _set_aside(self, path: Path, why: str) -> None:
        aside = path.with_name(path.name + ".broken")
        try:
            path.replace(aside)
            where = f"moved it to {aside}"
        except OSError as e:
            where = f"could not move it ({e})"
        warnings.warn(f"plan cache entry {path} cannot be used ({why}); {where} and planning again",
                      PlanCacheWarning, stacklevel=4)

    def store(self, plan) -> None:
        """Keep `plan` under its key."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            plan.save(self.path(plan.key))
        except OSError:
            pass  # a read-only cache directory only costs the next run a search
