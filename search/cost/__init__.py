"""The cost model: what a partitioned program costs per device and per step (compute,
communication per mesh axis, peak memory), on a device's figures, as XLA runs it.

Imports go one way: this subpackage reads `partir` (and `tactics.check` for settings)
and nothing of the search around it, which scores its plans with `CostModel`.

- `CostModel(part, device)` (`_model`): incremental costing of a `partir.Partitioning`;
  the step's time (`_time`, with what a real device achieves, `_achieved`: matmul
  throughput, overlap) and peak (`_peak`) assembled from per-op prices; `Cost`
  (`_breakdown`) and its tables (`_report`).
- Work (`_flops`, from the op traits), communication (`_comm`; sums of reductions
  reduced once on XLA:GPU, `_reassociate`), what XLA materializes
  (`_fusion`, `_stacks`, `_attention`), buffer lifetimes (`_memory`, `_arena`,
  `_move_buffers`, `_remat`), hand-partitioned regions (`_manual`), pipeline stages (`_pipeline`: `pipeline_cost`;
  their timelines, `_timeline`: `gpipe_timeline`).
- Devices (`_device`): presets (`h100`, `h200`, `a100`, `a100-efa`, `v100`, `tpu-v4`,
  `tpu-v5e`, `tpu-v5p`, `cpu`) or a user's JSON/TOML description; `_validate` holds the model
  against XLA's compiled HLO and memory.
"""

from ._breakdown import Cost
from ._comm import CollectiveCost, LinkModel
from ._device import DEFAULT_DEVICE, PRESETS, DeviceError, DeviceSpec, get_device, link_levels
from ._fusion import Materialization, materialization
from ._model import BACKENDS, CostModel
from ._pipeline import PipelineCost, bubble as pipeline_bubble, pipeline_cost
from ._timeline import Slot, TickTimes, gpipe_timeline, onef_timeline
from ._report import collectives_table
from ._units import bytes_str, time_str
from ._validate import Fidelity, compare_with_xla

__all__ = ["BACKENDS", "DEFAULT_DEVICE", "PRESETS", "CollectiveCost", "Cost", "CostModel", "DeviceError", "DeviceSpec", "Fidelity",
           "LinkModel", "Materialization", "PipelineCost", "Slot", "TickTimes", "bytes_str", "collectives_table",
           "compare_with_xla", "get_device", "gpipe_timeline", "onef_timeline", "link_levels", "materialization", "pipeline_bubble", "pipeline_cost",
           "time_str"]
