"""Taking a change to a partitioning again without working it out again: `delta(mark)`
records what every action since `mark` changed (final tilings, factor tilings, pins,
boundaries, rematerialized and reused values, token orders, rings, decisions, pipelines), and `replay(delta)` sets a
partitioning in the state the delta started from to the state it ended in, logged as
one step per entry so that `rollback` undoes it as it would the actions. A search that
applies the same action to the same state again and again (episodes retracing a tree
path, hill climbing that re-applies a plan's prefix per neighbour) pays for the tactic
and the propagation once, and for a copy of what changed thereafter."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import PartitioningError
from ._propagate import _BND, _DEC, _FAC, _ORD, _PIN, _PIP, _REM, _REU, _RNG, _SAV, _VAL


@dataclass(frozen=True, slots=True)
class Delta:
    """What the actions since a mark changed: `(class, dims)` of each tiling class,
    `(op, factor tiling)` of each op and `(class, forbidden axes)` of each pin as they
    ended, the classes made boundaries, the values rematerialized and reused, the
    token orders set (`(sequence, (axis, balance))`), the decisions taken; the state's key
    before and after them (`Partitioning.key`); and the pipelines added
    (`Partitioning.pipeline`) and the values ringed (`Partitioning.ring`)."""

    classes: tuple
    ops: tuple
    pins: tuple
    boundary: tuple
    remat: tuple
    reuse: tuple
    orders: tuple
    decisions: tuple
    before: int
    after: int
    pipelines: tuple = ()  # the `Pipelining`s added
    rings: tuple = ()  # `(value, (dim, axis))` of each value ringed (`Partitioning.ring`)
    save: tuple = ()  # the values saved for recomputations (`Partitioning.save`)

    @property
    def size(self) -> int:
        """How many entries the delta holds (what replaying it costs)."""
        return len(self.classes) + len(self.ops) + len(self.pins) + len(self.decisions)


class Replay:
    """Mixin of `Partitioning`: `delta` and `replay` over its state and undo log."""

    def delta(self, mark: int, before: int) -> Delta:
        """What changed since `mark` (a `mark()` taken when the state's key was `before`)."""
        first: dict = {}
        decisions = 0
        pipelines = []
        for entry in self._log[mark:]:
            if entry[0] == _DEC:
                decisions += 1
            elif entry[0] == _PIP:
                pipelines.append(entry[1])
            else:
                first.setdefault((entry[0], entry[1]), None)
        of = {kind: [i for k, i in first if k == kind] for kind in (_VAL, _FAC, _PIN, _BND, _REM, _REU, _ORD, _RNG, _SAV)}
        return Delta(tuple((c, self._d[c]) for c in of[_VAL]), tuple((o, self._f[o]) for o in of[_FAC]),
                     tuple((c, self._forbid[c]) for c in of[_PIN]), tuple(of[_BND]), tuple(of[_REM]),
                     tuple(of[_REU]), tuple((s, self._orders[s]) for s in of[_ORD]),
                     tuple(self._decisions[len(self._decisions) - decisions:]), before, self._hash,
                     tuple(pipelines), tuple((v, self._rings[v]) for v in of[_RNG]), tuple(of[_SAV]))

    def replay(self, delta: Delta) -> None:
        """Take `delta` again, from the state it started in (the same `key()`)."""
        if self._hash != delta.before:
            raise PartitioningError("a delta replays only on the state it was recorded from "
                                    f"(key {delta.before}, this one is {self._hash})")
        # The key is a function of the state alone: from the same state, the same one.
        log, D, Fs, forbid = self._log, self._d, self._f, self._forbid
        for c, new in delta.classes:
            log.append((_VAL, c, D[c]))
            D[c] = new
        self._touched_classes.update(c for c, _ in delta.classes)
        for o, new in delta.ops:
            log.append((_FAC, o, Fs[o]))
            Fs[o] = new
        self._touched_ops.update(o for o, _ in delta.ops)
        for c, new in delta.pins:
            log.append((_PIN, c, forbid[c]))
            forbid[c] = new
        for kind, chosen, items in ((_BND, self._boundary, delta.boundary), (_REM, self._remat, delta.remat),
                                    (_REU, self._reuse, delta.reuse), (_SAV, self._save, delta.save)):
            chosen.update(items)
            log.extend((kind, i) for i in items)
        for s, entry in delta.orders:
            log.append((_ORD, s, self._orders.get(s)))
            self._orders[s] = entry
        for v, entry in delta.rings:
            self._rings[v] = entry
            self._touched_classes.add(self._of[v])
            log.append((_RNG, v))
        self._decisions.extend(delta.decisions)
        log.extend((_DEC,) for _ in delta.decisions)
        self._pipelines += delta.pipelines
        log.extend((_PIP, p) for p in delta.pipelines)
        self._hash = delta.after
