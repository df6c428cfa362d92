"""partir: the partitioning IR of automap.

`lift` turns a function into a `Program` (a flat graph of values and ops over the
jaxpr and its nested jaxprs); a `Partitioning` holds one `Tiling` per value, changed
by `tile`/`replicate` actions and completed by factor-rule propagation; `lower` (the
`partir.lowering` subpackage) turns it into a sharded `jax.jit` callable, XLA's partitioner
or each device's program placing the collectives; `collectives_of` reads back what XLA
inserted.
"""

from . import rules
from ._attention import (MAX_HEAD_DIM, Attention, DimClasses, KernelRegion, attentions, dim_classes, is_mask,
                         kernel_region)
from ._dump import dump
from ._order import BALANCES, OrderSites, order_axes, order_sites, token_order
from ._graph import UnionFind, call_roots, computations, depended_on, made_from_scalars, makers_of
from ._errors import PartitioningError, UnknownPrimitiveWarning
from ._hlo import Collective, collective_buffers, collectives, collectives_of, summarize
from ._ir import Op, Program, Region, Value, path_matches
from ._lift import lift
from ._roll import roll_layers
from ._stacked import Stacked, StackedLeaf, stack_layers
from ._layers import input_layers, layer_keys
from ._mesh import MeshSpec, lowering_mesh
from ._nested import Link
from ._remat import POLICIES as REMAT_POLICIES
from ._remat import Layer, Recompute, layers_of, recompute, recomputed, residual_layers, saved_dots
from ._dot_roles import DOT_ROLES, dot_roles
from ._checkpoint import (Relaxation, UserCheckpoint, checkpoints_of, relaxation, remat_layers, reusable,
                          scan_body_of, user_checkpoints)
from ._decision import Decision, Reshard
from ._partitioning import Partitioning
from ._online import CHAIN_PRIMITIVES, OnlineAttention, OnlineForward, Unmatched, online_reason
from ._online_scans import OnlineAcrossScans, online_attentions
from ._rings import RING_KINDS, RingMove, ring_moves
from ._pipeline import (MICROBATCH, SCHEDULES as PIPELINE_SCHEDULES, Pipelining, ScanLayout, kept_in_slots, made_at, onef_gathered, state_dim,
                        microbatched, stage_chunks)
from ._stage_split import StageSplit
from ._onef_schedule import OnefSchedule
from ._pipeline_head import HeadLayout, check_pipeline, check_pipelines, head_layout, onef_outputs
from ._scans import LayerScans, ScanCall, body_regions, layer_scans, stacked_outputs
from ._reshard import Kind, Transition, permuted_dims, transition
from ._rule import FactorRule, factor_rule
from ._tiling import Tiling
from ._uniform import uniform_dims
from .lowering import CONSTRAIN_MODES, lower, register_backend
from ._verify import check_equivalence

__all__ = [
    "BALANCES", "OrderSites", "order_axes", "order_sites", "token_order", "MAX_HEAD_DIM", "Attention", "DimClasses", "KernelRegion", "attentions", "dim_classes", "is_mask", "kernel_region",
    "Layer", "REMAT_POLICIES", "Recompute", "residual_layers", "input_layers", "layers_of", "layer_keys", "recompute",
    "recomputed", "saved_dots", "DOT_ROLES", "dot_roles", "Relaxation", "UserCheckpoint", "checkpoints_of", "relaxation", "remat_layers", "reusable",
    "scan_body_of", "user_checkpoints",
    "Collective", "CONSTRAIN_MODES", "Kind", "UnionFind", "call_roots", "computations", "depended_on", "made_from_scalars", "makers_of", "Decision", "FactorRule", "MICROBATCH", "PIPELINE_SCHEDULES", "Pipelining", "ScanLayout", "StageSplit", "OnefSchedule", "made_at", "state_dim", "check_pipelines", "kept_in_slots", "onef_gathered", "microbatched", "stage_chunks", "HeadLayout", "check_pipeline", "head_layout", "onef_outputs", "LayerScans", "ScanCall", "body_regions", "layer_scans", "stacked_outputs", "Link", "MeshSpec", "Op", "Partitioning",
    "PartitioningError", "Program", "Region", "Reshard", "CHAIN_PRIMITIVES", "OnlineAttention", "OnlineForward", "OnlineAcrossScans", "Unmatched", "online_attentions", "online_reason", "RING_KINDS", "RingMove", "ring_moves", "Tiling", "Transition",
    "UnknownPrimitiveWarning", "Value", "check_equivalence", "collective_buffers", "collectives", "collectives_of",
    "dump",
    "factor_rule", "lift", "roll_layers", "stack_layers", "Stacked", "StackedLeaf", "lower", "lowering_mesh", "path_matches", "register_backend", "rules", "summarize",
    "permuted_dims",
    "transition", "uniform_dims",
]
