"""What the backward pass recomputes and reads, as a `Partitioning` records it
(`partir._remat`, `partir._checkpoint`): the residuals rematerialized (`remat`), the
values a user checkpoint reads from the forward pass instead of recomputing them
(`reuse`) and the values a recomputation reads instead of remaking them (`save`); each
a set of values, changed by decisions and undone on rollback."""

from __future__ import annotations

from ._decision import Decision
from ._errors import PartitioningError
from ._propagate import _REM, _REU, _SAV


class Recomputed:
    """Mixin of `Partitioning`: `remat`, `reuse` and `save` over its state and undo log."""

    def remat(self, value, *, source: str = "user") -> None:
        """Do not keep residual `value` for the backward pass: recompute it there from kept
        values (`partir._remat`). A no-op when it is recomputed already; a
        `PartitioningError` for a value that is no residual of a block."""
        from ._remat import residual_layers

        self._choose(_REM, self._remat, value, source,
                     lambda v: any(v in b.residuals for b in residual_layers(self.program)),
                     "cannot rematerialize {}: it is not a value a layer's forward pass keeps for the backward pass")

    @property
    def rematerialized(self) -> frozenset:
        """The residuals recomputed in the backward pass instead of kept."""
        return frozenset(self._remat)

    def reuse(self, value, *, source: str = "user") -> None:
        """Relax the user's `jax.checkpoint`: its backward region reads, instead of
        recomputing `value`, the forward value it is a rerun of (`partir._checkpoint`),
        which the forward pass then keeps. A no-op when it is reused already; a
        `PartitioningError` for a value no user checkpoint recomputes."""
        from ._checkpoint import reruns_of

        self._choose(_REU, self._reuse, value, source, lambda v: v in reruns_of(self.program),
                     "cannot reuse a forward value for {}: no jax.checkpoint region of the backward pass "
                     "recomputes it")

    @property
    def reused(self) -> frozenset:
        """The values of user checkpoints read from the forward pass, not recomputed."""
        return frozenset(self._reuse)

    def save(self, value, *, source: str = "user") -> None:
        """Keep `value`, made in a layer's forward pass, for the recomputation of that
        layer's rematerialized residuals to read instead of remaking it (a matmul output
        a policy saves, `partir._remat`). A no-op when it is saved already."""
        from ._remat import layer_values

        self._choose(_SAV, self._save, value, source, lambda v: v in layer_values(self.program),
                     "cannot save {}: no layer's forward pass makes it")

    @property
    def saved(self) -> frozenset:
        """The values recomputations read instead of remaking them."""
        return frozenset(self._save)

    def _choose(self, kind: int, chosen: set, value, source: str, allowed, refusal: str) -> None:
        """Add `value` to the set `chosen` as a `remat`/`reuse` decision (undone as `kind`
        on rollback); a no-op when it is in already, a `PartitioningError` (`refusal`
        with the value's name) when `allowed(value id)` is false."""
        v = self.program.resolve(value)
        if v in chosen:
            return
        if not allowed(v):
            raise PartitioningError(refusal.format(self.program.name(v)))
        chosen.add(v)
        self._log.append((kind, v))
        self._hash ^= hash((kind, v))
        self._decide(Decision({_REM: "remat", _REU: "reuse", _SAV: "save"}[kind], v, None, None, source))

