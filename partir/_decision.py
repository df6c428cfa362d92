"""What a partitioning records: the decisions that made it (`Decision`, the actions a
plan file replays) and the reshard points it leaves (`Reshard`)."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import PartitioningError
from ._ir import Program
from ._tiling import Tiling


#: The actions a `Decision` records (the `Partitioning` methods that take them).
ACTIONS = ("tile", "replicate", "constrain", "pin", "remat", "reuse", "save", "reorder", "ring")


@dataclass(frozen=True, slots=True)
class Decision:
    """One action taken on a partitioning, with who took it (a tactic name or 'user')."""

    action: str
    value: int
    dim: int | None
    axis: str | tuple[str, ...] | None  # a tuple only for "reorder" over several axes
    source: str
    axes: tuple[str, ...] | None = None  # for "pin": the axes the value may not be split over
    tiling: Tiling | None = None  # for "constrain": the layout fixed
    order: str | None = None  # for "reorder": the token order (a `partir.BALANCES` name)

    def to_json(self, program: Program) -> dict:
        """The decision as JSON (a plan file's entry): `action`, `value` (id) and its
        `name` in `program`, `source`, and `dim` and `axis` (tile), `axes` (pin),
        `tiling` (constrain), `dim`, `axis` and `order` (reorder), `dim` and `axis` (ring)."""
        out = {"action": self.action, "value": self.value, "name": program.name(self.value), "source": self.source}
        if self.action in ("tile", "reorder", "ring"):
            out.update(dim=self.dim, axis=self.axis)
        if self.order is not None:
            out["order"] = self.order
        if self.axes is not None:
            out["axes"] = list(self.axes)
        if self.tiling is not None:
            out["tiling"] = self.tiling.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict, program: Program) -> "Decision":
        """The decision `to_json` wrote, on `program`'s value of the same id (the `name`
        is not checked here). A `PartitioningError` for an unknown action, a missing
        field or a value id the program does not have."""
        action = data.get("action")
        _check_action(action)
        need = {"tile": ("value", "dim", "axis"), "ring": ("value", "dim", "axis"), "constrain": ("value", "tiling"),
                "reorder": ("value", "dim", "axis", "order")}.get(action, ("value",))
        missing = [k for k in need if data.get(k) is None]
        if missing:
            raise PartitioningError(f"a {action!r} decision needs {', '.join(need)}; {data!r} lacks {', '.join(missing)}")
        v = program.resolve(data["value"])
        tiling = Tiling.from_json(data["tiling"]) if action == "constrain" else None
        axes = tuple(data["axes"]) if data.get("axes") is not None else None
        axis = data.get("axis")
        if isinstance(axis, list):  # a token order made for several axes, as JSON wrote its tuple
            axis = tuple(axis)
        return cls(action, v, data.get("dim"), axis, data.get("source", "plan"), axes, tiling, data.get("order"))


def _check_action(action) -> None:
    if action not in ACTIONS:
        raise PartitioningError(f"unknown decision action {action!r}; the known actions are {', '.join(ACTIONS)}")


@dataclass(frozen=True, slots=True)
class Reshard:
    """A point where a value must change layout: before op `op` consumes it (`side` ==
    'operand') or after `op` produces it (`side` == 'result'; `src` may be partial)."""

    op: int
    value: int
    side: str
    index: int
    src: Tiling
    dst: Tiling
