"""automap: an SPMD auto-partitioner for JAX.

The user-facing layer over the IR (`partir`), the tactics (`tactics`) and the search
(`search`):

- `automap.jit(step, mesh=...)`: plan (or load the cached plan), lower and run a train
  step, like `jax.jit`;
- `automap.partition(step, mesh=..., schedule=...)(*args)`: a `Plan` without running it;
- `Plan`: shardings, specs, cost, history, `jit(lowering=)`, `shard_args()`, `explain()`,
  `save()`, `plot()`; `automap.load_plan(path).bind(step, *args)` applies a saved one;
- the `automap` command: `automap search`, `automap show`, `automap demo`.
"""

__version__ = "0.1.0"

from ._api import AutomapFunction, jit, partition  # noqa: E402
from ._plan import LOWERINGS, Plan, PlanError, SavedPlan, load_plan  # noqa: E402

__all__ = ["AutomapFunction", "LOWERINGS", "Plan", "PlanError", "SavedPlan", "jit", "load_plan", "partition"]
