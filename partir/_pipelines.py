"""The pipelines a `Partitioning` holds: which layer scans run as stages (a mixin, beside
`partir._pipeline`, which defines a `Pipelining` and the microbatched plan and imports
`Partitioning` to build it)."""

from __future__ import annotations

from ._errors import PartitioningError
from ._propagate import _PIP


class Pipelines:
    """Mixin of `Partitioning`: the layer scans it runs as pipeline stages."""

    def pipeline(self, pipelining) -> None:
        """Run a layer scan's layers as pipeline stages (a `partir.Pipelining`; its
        stacked values are split over its stage axis by the caller's `tile`s)."""
        if any(set(p.bodies) & set(pipelining.bodies) for p in self._pipelines):
            raise PartitioningError("these layer scans are pipelined already: give one Pipeline per layer stack")
        self._pipelines += (pipelining,)
        self._log.append((_PIP, pipelining))
        self._hash ^= hash((_PIP, pipelining))

    @property
    def pipelines(self) -> tuple:
        """The layer scans run as pipeline stages (`partir.Pipelining`s)."""
        return self._pipelines
