"""How a layer scan's L layers fall into the slots of S pipeline stages, R chunks a
stage under the circular schedule (`StageSplit`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageSplit:
    """`length` layers in S*R contiguous chunks (`stages` S, `repeats` R: chunk c runs on
    stage c mod S, in its round c // S; R = 1 is GPipe's contiguous stages). Every chunk
    has `chunk` = ceil(L/(S*R)) layer slots, so a stage has `slots` = R*chunk; when S*R
    does not divide L the first `fuller` chunks run `chunk` layers and the others one
    fewer, their last slot padding (every chunk runs at least floor(L/(S*R)) layers,
    none runs none). `rolled`: the layers were rolled from unrolled ones
    (`partir.roll_layers`), whose per-layer arrays cannot be held split along the
    stacked layer dim, so the stages exchange their layers as uneven ones do."""

    length: int
    stages: int
    rolled: bool = False
    repeats: int = 1

    @property
    def chunks(self) -> int:
        """Chunks of the layers: S*R."""
        return self.stages * self.repeats

    @property
    def chunk(self) -> int:
        """Layer slots per chunk: ceil(L/(S*R))."""
        return -(-self.length // self.chunks)

    @property
    def slots(self) -> int:
        """Layer slots per stage: R * ceil(L/(S*R)) (ceil(L/S) with one repeat)."""
        return self.repeats * self.chunk

    @property
    def uneven(self) -> bool:
        """Do some chunks hold a padding slot (S*R does not divide L)?"""
        return self.length % self.chunks != 0

    @property
    def exchanged(self) -> bool:
        """Do the stacked values stay [L, ...] at rest (split over the stage axis along
        another dim), each step exchanging the stage's layers in and out (`uneven` or
        `rolled`)?"""
        return self.uneven or self.rolled

    @property
    def fuller(self) -> int:
        """How many chunks (the first ones) run `chunk` layers; the others run one fewer
        (with one repeat, the stages)."""
        return self.length - self.chunks * (self.chunk - 1)

    def chunk_layers(self, c: int) -> range:
        """The layers chunk `c` runs."""
        first = c * (self.chunk - 1) + min(c, self.fuller)
        return range(first, first + self.chunk - (c >= self.fuller))

    def stage_layers(self, s: int) -> tuple[range, ...]:
        """The layers stage `s` runs, per round (its chunks s, s+S, ..., in order)."""
        return tuple(self.chunk_layers(k * self.stages + s) for k in range(self.repeats))

    def count(self, s: int) -> int:
        """How many layers stage `s` runs."""
        return sum(len(r) for r in self.stage_layers(s))

    def layers(self) -> tuple[tuple[int, ...], ...]:
        """Per stage, the layers it runs, in the order it runs them."""
        return tuple(tuple(i for r in self.stage_layers(s) for i in r) for s in range(self.stages))

    def positions(self) -> np.ndarray:
        """[S, slots]: the layer each stage's slot holds (its chunks' slots in round
        order), L for a padding slot."""
        out = np.full((self.stages, self.slots), self.length)
        for s in range(self.stages):
            for k, r in enumerate(self.stage_layers(s)):
                out[s, k * self.chunk:k * self.chunk + len(r)] = list(r)
        return out
