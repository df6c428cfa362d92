"""Plan files: `load_plan(path)` reads and checks one, `SavedPlan.bind` checks it
against a program and makes the `Plan`."""

from __future__ import annotations

import json
from pathlib import Path

import jax

import partir
from partir import MeshSpec, PartitioningError, Tiling
from tactics import check as checks

from ._args import LOWERINGS
from ._errors import PlanError
from ._plan import FORMAT, READABLE, Plan, dtype_text

#: Fields every plan file has, with the JSON type each must be.
REQUIRED = {"mesh": dict, "inputs": list, "outputs": list, "decisions": list}


class SavedPlan:
    """A plan read from a file, not yet bound to a program: `bind(fn, *args)` checks it
    against the program and returns a `Plan`; `data` is the file's content."""

    def __init__(self, data: dict, path: str = "<dict>"):
        problems = structure(data)
        if problems:
            raise PlanError(f"plan {path} is malformed: " + "; ".join(problems[:5])
                            + ("; ..." if len(problems) > 5 else "") + ": fix or delete the file")
        self.data = data
        self.path = path
        self.mesh = MeshSpec(tuple((k, int(v)) for k, v in data["mesh"].items()))

    def bind(self, fn, *args, static_argnums=(), jax_mesh=None) -> Plan:
        """The plan for `fn(*args)`, checked: the mesh, every input's name, shape, dtype
        and spec, and every split's divisibility. A `PlanError` lists everything that
        does not fit. Decisions are replayed when the program is the one the plan was
        made for (and the inputs must then come out as the file says); otherwise the
        saved input layouts are applied and propagated."""
        return self.bind_program(partir.lift(fn, *args, static_argnums=static_argnums), jax_mesh)

    def bind_program(self, prog, jax_mesh=None) -> Plan:
        """`bind` for a program already lifted (its unrolled layers rolled into layer scans
        where the plan pipelines them and it has none, as the plan was made)."""
        if self.data.get("pipelines") and not partir.layer_scans(prog) and partir.input_layers(prog):
            try:
                prog = partir.roll_layers(prog)
            except PartitioningError as e:
                raise PlanError(f"plan {self.path} pipelines layers this program's do not roll into: {e}") from None
        problems = check(self.data, prog, jax_mesh)
        if problems:
            raise PlanError(f"plan {self.path} does not fit this program:\n  - " + "\n  - ".join(problems))
        decisions = self.data["decisions"]
        replay = bool(decisions) and all(d.get("name") == _name(prog, d.get("value")) for d in decisions)
        part = partir.Partitioning(prog, self.mesh, detached=self._detached(prog) if replay else ())
        if replay:
            self._replay(part, decisions)
        else:
            for item in self.data["inputs"]:
                v = prog.inputs[prog.input_names.index(item["name"])]
                for dim, axes in enumerate(Tiling.from_json(item["spec"]).dims):
                    for a in axes:
                        try:
                            part.tile(v, dim, a, source=f"plan {self.path}")
                        except PartitioningError as e:
                            raise PlanError(f"plan {self.path}, input {item['name']}: {e}") from None
        self._pipelines(part)
        return Plan(part, device=_device(self.data), memory_limit=self.data.get("memory_limit"),
                    donate_argnums=self.data.get("donate_argnums", ()), schedule_text=self.data.get("schedule", ()),
                    jax_mesh=jax_mesh, key=self.data.get("key", ""), made_for=self.data.get("made_for"),
                    lowering=self.data.get("lowering", "jit"))

    def _pipelines(self, part) -> None:
        """The layer scans the plan runs as pipeline stages."""
        for i, entry in enumerate(self.data.get("pipelines", ())):
            try:
                part.pipeline(partir.Pipelining.from_json(entry, part.program))
                partir.check_pipelines(part)
            except (PartitioningError, KeyError, TypeError, ValueError) as e:
                raise PlanError(f"plan {self.path}, pipelines[{i}]: {e}; fix the entry or delete the file") from None

    def _detached(self, prog) -> list[int]:
        """The values the plan's tactics detached from their tiling classes (ZeRO below
        stage 3 keeps the parameters whole apart from their optimizer state), by name."""
        try:
            return [prog.resolve(name) for name in self.data.get("detached", ())]
        except (PartitioningError, TypeError) as e:
            raise PlanError(f"plan {self.path}, detached: {e}; fix the entry or delete the file") from None

    def _replay(self, part, decisions) -> None:
        prog = part.program
        for i, d in enumerate(decisions):
            what = f"plan {self.path}, decision {i} ({d.get('action')} of {d.get('name')})"
            try:
                part.redo(partir.Decision.from_json(d, prog))
            except (PartitioningError, KeyError, TypeError, ValueError) as e:
                raise PlanError(f"{what}: {e}; fix the decision or delete the file") from None
        by_name = dict(zip(prog.input_names, prog.inputs))
        for item in self.data["inputs"]:
            got = part.tiling(by_name[item["name"]]).to_json()
            if got != item["spec"]:
                raise PlanError(f"plan {self.path}: input {item['name']} has spec {item['spec']} in the file, but its "
                                f"decisions give {got}; edit the decisions to match, or remove the 'decisions' list "
                                "to apply the inputs' specs alone")


def _device(data):
    """The plan's device: its name when that names the same figures here (a preset),
    else the description the file holds (a device file the plan was made with)."""
    import search

    name, spec = data.get("device", search.DEFAULT_DEVICE), data.get("device_spec")
    if not isinstance(spec, dict):
        return name
    try:
        described = search.DeviceSpec.from_dict(spec)
    except search.DeviceError as e:
        raise PlanError(f"the plan's device_spec cannot be used: {e}") from None
    try:
        return name if search.get_device(name) == described else described
    except search.DeviceError:
        return described


def _name(prog, v):
    return prog.name(v) if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(prog.values) else None


def _spec_problem(spec, rank: int, axes) -> str | None:
    entries_ok = isinstance(spec, list) and all(
        e is None or isinstance(e, str) or (isinstance(e, list) and all(isinstance(a, str) for a in e)) for e in spec)
    if not entries_ok:
        return f"spec {spec!r} is not a list of per-dim entries (each null, an axis name or a list of axis names)"
    if len(spec) != rank:
        return f"spec {spec!r} has {len(spec)} entries for a value of rank {rank}"
    named = [a for e in spec if e is not None for a in ([e] if isinstance(e, str) else e)]
    unknown = [a for a in named if a not in axes]
    if unknown:
        return f"spec {spec!r} names {unknown[0]!r}, which is not an axis of the plan's mesh {list(axes)}"
    if len(set(named)) != len(named):
        return f"spec {spec!r} uses an axis twice"
    return None


def structure(data) -> list[str]:
    """What makes `data` no plan file of a readable format (empty when it is one)."""
    if not isinstance(data, dict):
        return [f"the file holds a JSON {type(data).__name__}, not an object"]
    if data.get("format") != FORMAT:
        return [f"format is {data.get('format')!r}, not {FORMAT!r}: this is not an automap plan"]
    version = data.get("version")
    if isinstance(version, bool) or version not in READABLE:
        return [f"version {version!r} is not one this automap reads ({', '.join(map(str, READABLE))})"]
    problems = [f"{k!r} is missing" if k not in data else f"{k!r} is a {type(data[k]).__name__}, not a "
                f"{t.__name__}" for k, t in REQUIRED.items() if not isinstance(data.get(k), t)]
    if problems:
        return problems
    try:
        MeshSpec(tuple(data["mesh"].items()))
    except PartitioningError as e:
        problems.append(f"mesh: {e}")
    for i, item in enumerate(data["inputs"]):
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("dtype"), str)
                and isinstance(item.get("shape"), list) and all(isinstance(n, int) for n in item["shape"])):
            problems.append(f"inputs[{i}] needs a name, a shape (a list of ints), a dtype and a spec")
            continue
        bad = _spec_problem(item.get("spec"), len(item["shape"]), data["mesh"])
        if bad:
            problems.append(f"input {item['name']}: {bad}")
    problems += [f"decisions[{i}] is not an object" for i, d in enumerate(data["decisions"]) if not isinstance(d, dict)]
    problems += _cost_problems(data.get("cost"))
    if data.get("memory_limit") is not None:  # null: the device's memory
        problems += _number_problem("memory_limit", data["memory_limit"], example="80e9 (bytes per device) or null")
    if data.get("lowering", "jit") not in LOWERINGS:
        problems.append(f"lowering {data['lowering']!r} is not one of {', '.join(map(repr, LOWERINGS))}")
    donate = data.get("donate_argnums", [])
    if not (isinstance(donate, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in donate)):
        problems.append(f"donate_argnums {donate!r} is not a list of ints")
    return problems


def _cost_problems(cost) -> list[str]:
    if cost is None:
        return []
    numbers = ("step_time_s", "compute_time_s", "comm_time_s", "memory_peak_bytes")
    if not (isinstance(cost, dict) and all(isinstance(cost.get(k), (int, float)) for k in numbers)
            and isinstance(cost.get("fits"), bool) and isinstance(cost.get("collectives_by_axis"), dict)):
        return [f"cost needs {', '.join(numbers)} (numbers), fits (a bool) and collectives_by_axis (an object)"]
    return [p for k in numbers for p in _number_problem(f"cost {k}", cost[k], sign="non-negative")]


def _number_problem(where: str, value, **how) -> list[str]:
    """What `tactics.check.number` says of a number in the file (empty when it is one)."""
    try:
        checks.number(where, value, error=PlanError, **how)
    except PlanError as e:
        return [str(e)]
    return []


def check(data: dict, prog, jax_mesh=None) -> list[str]:
    """What in plan `data` (of a good `structure`) does not fit program `prog` (and the
    real mesh, if given)."""
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
        problems += _input_problems(item, prog.values[v], mesh)
    known = {i["name"] for i in data["inputs"]}
    missing = [n for n in prog.input_names if n not in known]
    if missing:
        problems.append(f"the plan does not know input(s) {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    return problems


def _input_problems(item: dict, val, mesh: MeshSpec) -> list[str]:
    name = item["name"]
    if list(val.shape) != list(item["shape"]):
        return [f"input {name} has shape {tuple(val.shape)}, the plan expects {tuple(item['shape'])}"]
    if dtype_text(val.dtype) != item["dtype"]:
        return [f"input {name} has dtype {dtype_text(val.dtype)}, the plan expects {item['dtype']}"]
    problems = []
    for d, entry in enumerate(item["spec"]):  # `structure` checked the axes are the mesh's
        axes = [] if entry is None else [entry] if isinstance(entry, str) else entry
        k = mesh.devices_along(axes)
        if val.shape[d] % k:
            problems.append(f"input {name} dim {d} (size {val.shape[d]}) is not divisible by the {k} devices of {axes}")
    return problems


def load_plan(path) -> SavedPlan:
    """Read a plan file written by `Plan.save`; `bind(fn, *args)` applies it. A
    `PlanError` says what is wrong with a file that is missing, unreadable, not JSON or
    not a plan of a format this automap reads."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"no plan file at {path}") from None
    except IsADirectoryError:
        raise PlanError(f"{path} is a folder, not a plan file: give the path of a .json plan") from None
    except UnicodeDecodeError as e:
        raise PlanError(f"{path} is not a plan file (not UTF-8 text: {e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{path} is not a plan file (invalid JSON: {e})") from None
    except OSError as e:
        raise PlanError(f"cannot read plan file {path}: {e.strerror or e}") from None
    return SavedPlan(data, str(path))
