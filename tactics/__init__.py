"""tactics: schedules of partitioning tactics that rewrite a `partir.Partitioning`.

A schedule is a list of tactics applied in order by `apply_schedule`, each propagated
before the next (earlier tactics win conflicts), with a history of every step:

    apply_schedule(program, mesh, [DataParallel("data"), Megatron("model")])

Manual: `Shard`, `Replicate`, `Specs`. Strategies: `DataParallel`, `Megatron`,
`ZeRO`/`FSDP`, `SequenceParallel`, `ContextParallel`, `ExpertParallel`. Memory: `Remat`.
Stages: `Pipeline`. A glob that matches
inputs it cannot tell apart (a dict key holding '/') warns `AmbiguousPatternWarning`.
"""

from . import _checks as check
from ._checks import AmbiguousPatternWarning
from ._base import Context, Partitioned, Step, Tactic, TacticError, applied_order, apply_schedule
from ._context import ContextParallel
from ._data import DataParallel, batch_inputs
from ._groups import Group, input_groups
from ._expert import ExpertParallel, expert_activations, expert_weights
from ._manual import Replicate, Shard, Specs
from ._megatron import WHY, Block, LeftOut, Megatron, Use, weight_uses
from ._pipeline import Pipeline
from ._remat import Remat
from ._roles import Roles, roles, weight_dims, weight_root
from ._sequence import SequenceParallel
from ._zero import FSDP, ZeRO, zero_whole
from ._registry import TACTICS, WORDS, tactic_names

__all__ = ["check", "ContextParallel", "AmbiguousPatternWarning", "Group", "input_groups", "FSDP", "Block", "Context", "LeftOut", "Use", "WHY", "DataParallel", "ExpertParallel", "Megatron", "Partitioned", "Pipeline", "Remat", "Replicate",
           "Roles", "SequenceParallel", "Shard", "Specs", "Step", "Tactic", "TacticError", "TACTICS", "WORDS", "ZeRO", "applied_order", "apply_schedule", "tactic_names",
           "batch_inputs", "expert_activations", "expert_weights", "roles", "weight_dims", "weight_root", "weight_uses", "zero_whole"]
