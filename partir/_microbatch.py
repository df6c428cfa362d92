"""What a pipeline's microbatches are to the rest of `partir`: the sequential axis they
are cut along, how each op passes on a sum over them, and the kinds a scan body's value
takes across them (`partir._pipeline` and `partir._pipeline_defer` read these)."""

from __future__ import annotations

from ._tiling import Tiling

#: The sequential axis microbatches are cut along in `microbatched`: it is no device
#: axis, so a plan's mesh may not name it.
MICROBATCH = "microbatch"

#: How an op passes on a sum over microbatches (a result of a reduction over the batch),
#: by primitive: `unary` ops are linear in their one operand; `additive` ones add
#: operands that must all be such sums; `multilinear` ones are linear in each operand,
#: so exactly one may be a sum and the others the same for every microbatch;
#: `numerator` ones are linear in their first operand alone (a mean's division by the
#: count, which the loss between the layer scans makes).
LINEARITY = {
    **dict.fromkeys(("convert_element_type", "reshape", "transpose", "neg", "broadcast_in_dim", "reduce_sum",
                     "squeeze", "expand_dims", "copy", "copy_p", "reduce_precision"), "unary"),
    **dict.fromkeys(("add", "add_any", "sub"), "additive"),
    **dict.fromkeys(("mul", "dot_general"), "multilinear"),
    "div": "numerator",
}
#: Kinds of a body value across microbatches (`ScanLayout`).
SPLIT, SAME, SUM = "split", "same", "sum"


def _strip(t: Tiling) -> Tiling:
    """`t` without the microbatch axis, in its dims and its partial sums."""
    return Tiling(tuple(tuple(a for a in d if a != MICROBATCH) for d in t.dims),
                  tuple(a for a in t.partial if a != MICROBATCH), t.reduce_kind)
