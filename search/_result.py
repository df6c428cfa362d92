"""What a search returns: the best plan with its runners-up, and how the search went."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._actions import Action


@dataclass
class SearchStats:
    """How a search went: episodes run, distinct states, evaluations answered from the
    cache, wall time, why it stopped, and the best modeled step time over time as
    `(seconds, episode, step time)` whenever it improved."""

    episodes: int = 0
    states: int = 0
    cache_hits: int = 0
    evaluations: int = 0
    elapsed: float = 0.0
    stopped: str = ""
    trace: list = field(default_factory=list)
    min_peak: float = float("inf")  # the smallest peak memory of any plan seen
    #: (scored, offered): the assignments of roles to mesh axes among the macro seeds
    #: (`search.skeletons`) of which the search scored a variant before its budget ran out.
    assignments: tuple[int, int] = (0, 0)


@dataclass
class SearchResult:
    """The best plan found: its actions (in order), modeled step time and peak memory,
    whether it fits, the search statistics, and the runners-up it rejected.

    `AutomaticPartition` fills in how it ran: the input `groups` that tile actions name,
    the depths of the shallow `twins` it searched on (None: on the program itself) and
    `why` not on twins, or why searched again on the program ("" when on twins)."""

    actions: tuple[Action, ...]
    step_time: float
    memory_peak: float
    fits: bool
    root_step_time: float
    stats: SearchStats
    alternatives: tuple = ()  # the next best distinct plans seen: (actions, step time, peak)
    groups: tuple = ()
    twins: tuple[int, int] | None = None
    why: str = ""

    @property
    def macros(self) -> tuple:
        """The tactics the plan applies as macro actions, in order."""
        return tuple(a.tactic for a in self.actions if a.kind == "macro")
