"""search: the search that finds good partitionings, and the cost model it scores them
with (`search.cost`, re-exported here).

`AutomaticPartition` is the search as a tactic: Monte Carlo tree search (`_mcts`) over
tiling and macro actions (`_actions`) on a search state (`_state`), on the stacked form
of a deep model over unrolled layers (`_stacked`) or its shallow twins (`_twins`) where
that is sound, over the micro-batches of a step under
gradient accumulation (`_accum`); `exhaustive` (`_exact`) walks the same space
exactly for small problems.
"""

from .cost import (DEFAULT_DEVICE, PRESETS, CollectiveCost, Cost, CostModel, DeviceError, DeviceSpec, Fidelity,
                   LinkModel, Materialization, bytes_str, collectives_table, compare_with_xla, get_device, link_levels,
                   materialization, PipelineCost, Slot, TickTimes, gpipe_timeline, onef_timeline, pipeline_bubble, pipeline_cost,
                   time_str)
from ._actions import STOP, Action, Group, input_groups, valid_actions
from ._state import SearchState
from ._mcts import TreeSearch, mcts
from ._result import SearchResult, SearchStats
from ._accum import accumulated_step
from ._auto import AutomaticPartition
from ._seeds import compositions, primary_first, skeletons
from ._exact import ExactResult, exhaustive

__all__ = ["compositions", "primary_first", "skeletons", "DEFAULT_DEVICE", "PRESETS", "CollectiveCost", "Cost", "CostModel", "DeviceError", "DeviceSpec", "LinkModel",
           "bytes_str", "collectives_table", "get_device", "link_levels", "time_str", "Fidelity", "compare_with_xla",
           "STOP", "Action", "Group", "input_groups", "valid_actions", "SearchState", "SearchResult", "SearchStats",
           "TreeSearch", "mcts", "AutomaticPartition", "ExactResult", "exhaustive", "Materialization",
           "materialization", "PipelineCost", "Slot", "TickTimes", "gpipe_timeline", "onef_timeline", "pipeline_bubble",
           "pipeline_cost", "accumulated_step"]
