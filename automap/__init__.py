"""automap: an SPMD auto-partitioner for JAX.

The user-facing layer over the IR (`partir`), the tactics (`tactics`) and the search
(`search`):

- `automap.jit(step, mesh=...)`: plan (or load the cached plan), lower and run a train
  step, like `jax.jit`;
- `automap.partition(step, mesh=..., schedule=...)(*args)`: a `Plan` without running it;
- `Plan`: shardings, specs, cost, history, `jit()`, `shard_args()`, `explain()`,
  `save()`, `plot()`; `automap.load_plan(path).bind(step, *args)` applies a saved one;
- the `automap` command: `automap search`, `automap show`, `automap demo`.

Errors: `AutomapError` (a bad argument), `PlanError` (a plan that does not fit its
program, mesh or file), `MemoryLimitError` (no plan fits the memory limit); all are
`partir.PartitioningError`s.
"""

from ._version import __version__
from ._args import LOWERINGS
from ._errors import AutomapError, MemoryLimitError, PlanCacheWarning, PlanError
from ._plan import Plan
from ._planfile import SavedPlan, load_plan
from ._api import AutomapFunction, jit, partition

__all__ = ["LOWERINGS", "AutomapError", "AutomapFunction", "MemoryLimitError", "Plan", "PlanCacheWarning", "PlanError",
           "SavedPlan", "jit", "load_plan", "partition"]
