"""Where the search offers ZeRO-1 (Megatron's distributed optimizer) as a macro.

ZeRO below stage 3 keeps the parameters whole while it shards their optimizer state, so
it detaches the parameters, their updates and gradients from the tiling class they
share (`tactics.zero_whole`): a new partitioning, which a search state cannot swap in
mid-search. A search that offers ZeRO-1 therefore starts from a partitioning detached so
already: ZeRO then applies in place, and the other macros plan as they do undetached
(the optimizer state follows its parameter by propagation; checked on Llama 3.1 70B:
FSDP, Megatron and context parallelism give the same input layouts and cost either way).

It matters where gradients are accumulated: FSDP gathers its parameters again every
micro-batch (`search.cost._achieved.repeated_per_micro_batch`), ZeRO-1 once a step, with
the parameters whole for the whole accumulation, so the search needs both to choose
between them. Shallow twins take no detached partitioning (`search._twins`), so ZeRO-1 is
offered where the program itself is searched, which the scanned programs of
`benchmarks/published.py` are.
"""

from __future__ import annotations

from tactics import roles, zero_whole


def zero_root(part, grad_accum: int, macros: bool):
    """`part` detached as ZeRO-1 detaches it, for a search that accumulates gradients
    (`grad_accum` above 1) with macros, on a program with optimizer state to shard; None
    where ZeRO-1 is not offered (then the search starts from `part` itself)."""
    if grad_accum <= 1 or not macros or not roles(part.program).opt_state:
        return None
    keep = zero_whole(part.program, 1)
    return None if keep <= part.detached else part.detach(keep)


def offers_zero(part) -> bool:
    """Whether ZeRO-1 applies in place on `part` (it is detached as `zero_root` makes it),
    so the search may offer it as a macro."""
    return bool(roles(part.program).opt_state) and zero_whole(part.program, 1) <= part.detached
