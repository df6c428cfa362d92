"""search: the cost model of a partitioned program, and the search that finds good
partitionings with it.

`CostModel(part, device)` costs a `partir.Partitioning` (per-device compute,
communication per mesh axis, peak memory; incremental as the partitioning changes);
`get_device` resolves accelerator presets (`h100`, `h200`, `a100`, `v100`, `tpu-v4`,
`tpu-v5e`, `tpu-v5p`, `cpu`) or a user's JSON/TOML description.
"""

from ._comm import CollectiveCost, LinkModel
from ._breakdown import Cost, bytes_str, time_str
from ._cost import CostModel
from ._report import collectives_table
from ._device import DEFAULT_DEVICE, PRESETS, DeviceError, DeviceSpec, get_device, link_levels

__all__ = ["DEFAULT_DEVICE", "PRESETS", "CollectiveCost", "Cost", "CostModel", "DeviceError", "DeviceSpec", "LinkModel",
           "bytes_str", "collectives_table", "get_device", "link_levels", "time_str"]
from ._validate import Fidelity, compare_with_xla  # noqa: E402
from ._actions import STOP, Action, Group, input_groups, valid_actions  # noqa: E402
from ._state import SearchState  # noqa: E402
from ._mcts import TreeSearch, mcts  # noqa: E402
from ._result import SearchResult, SearchStats  # noqa: E402
from ._auto import AutomaticPartition  # noqa: E402
from ._exact import ExactResult, exhaustive  # noqa: E402
from ._fusion import Materialization, materialization  # noqa: E402

__all__ += ["Fidelity", "compare_with_xla", "STOP", "Action", "Group", "input_groups", "valid_actions",
            "SearchState", "SearchResult", "SearchStats", "TreeSearch", "mcts", "AutomaticPartition", "ExactResult", "exhaustive",
            "Materialization", "materialization"]
