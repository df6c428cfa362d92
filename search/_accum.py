"""Gradient accumulation: searching for the step of GA micro-batches a step.

A run that accumulates gradients over GA micro-batches runs the forward and backward
pass GA times and reduces the gradients and updates the parameters once. What grows
with the batch (compute, the activations' collectives) is paid GA times, and so is
what the batch does not grow but every micro-batch runs again: FSDP's parameter
all-gathers and its gradients' reduce-scatters (XLA runs a scanned layer's gathers in
every trip of every micro-batch and accumulates the gradient sharded like the
parameter, reducing each micro-batch's: docs/design.md, "Gradient accumulation";
`search.cost._achieved.repeated_per_micro_batch`). The rest (a gradient all-reduce,
the update, the all-gather of ZeRO's updated parameters) is paid once. So the
accumulated step is priced from the modeled train steps of one and of two
micro-batches' sequences (the program on a batch twice as large) and the collectives
of one run again (`again`, `CostModel.accumulation_parts`), each term of their
`TimeParts` (compute, and each computation's window and overlappable communication)
extrapolated,

    parts(GA) = parts(1) + (GA - 1) * (parts(2) - parts(1) + again(1)),

and overlap applied to the result (`accumulated_step`), as shallow twins extrapolate
in depth (`search._twins`). Extrapolating the step times themselves,
T(1) + (GA - 1) (T(2) - T(1)), would be wrong where overlap differs between the two:
a once-a-step collective exposed on one micro-batch and hidden behind two would count
as hidden GA - 1 times over, and the step come out under its own compute (measured:
FSDP on NeMo's Llama 3.1 8B, 128 H100s, 32 micro-batches, 10.7 s against 12.7 s of
compute). Where nothing changes overlap, both give the same step.

`benchmarks/published.py` prices a published run by this rule; searching by the step of
one micro-batch weighs the once-a-step costs GA times too much, and picks a plan that
avoids the gradient reduction at any price per micro-batch. The peak is one
micro-batch's (FSDP's gathered layer is freed within it) with the gradient accumulator
live throughout (`CostModel`'s `grad_accum`). Gathering the parameters once
and keeping them whole through the accumulation is a plan of its own, ZeRO-1, which
the search offers where it searches the program itself (`search._zero_root`).

The search traces the program again on two micro-batches (from the function and
abstract arguments `lift` keeps: every batch input's leading dim doubled), applies every
action to both, and scores the accumulated step. Either program may itself be searched
on shallow twins: the state of each is whatever the search would walk for it.
"""

from __future__ import annotations

import warnings

import jax

from partir import Partitioning, PartitioningError, lift
from tactics import TacticError, roles

from .cost._achieved import TimeParts
from ._state import PairedStates


def accumulated_step(one: TimeParts, two: TimeParts, grad_accum: int, device, again: TimeParts | None = None) -> float:
    """The modeled step (seconds) of `grad_accum` micro-batches a step on `device`, from
    the `TimeParts` of the train step on one and on two micro-batches and of the
    collectives of one that run again every micro-batch though the batch does not grow
    them (`again`, `CostModel.accumulation_parts`: FSDP's parameter gathers and gradient
    reduce-scatters): term by term (module docstring); where their computations differ,
    the step times affinely, the collectives run again exposed."""
    if one.parents != two.parents or (again is not None and again.parents != one.parents):
        t1, t2 = one.step(device)[0], two.step(device)[0]
        repeated = 0.0 if again is None else again.step(device)[0]
        return t1 + (grad_accum - 1) * (t2 - t1 + repeated)
    step = one.extrapolate(two, grad_accum - 1)
    return (step if again is None else step.plus(again, grad_accum - 1)).step(device)[0]


class AccumulatedState(PairedStates):
    """The search state of a train step run `grad_accum` times a step, kept as the
    states of its programs on one and on two micro-batches (`SearchState`s or
    `TwinState`s): every action goes to both, the step time is the accumulated one
    (`accumulated_step`), the peak memory one micro-batch's, with the gradient
    accumulator where the states' cost models hold one (`CostModel`'s `grad_accum`)."""

    def __init__(self, one, two, grad_accum: int):
        self.pair, self.grad_accum = (one, two), grad_accum
        self.axes = one.axes
        self.depths = one.depths

    @property
    def deepest_part(self):
        """The partitioning of the deepest program searched, on one micro-batch."""
        return self.pair[0].deepest_part

    def actions(self):
        """The tile actions that would change the one-micro-batch program (the programs
        have the same inputs, so the same groups)."""
        return self.pair[0].actions()

    def evaluate(self) -> tuple[float, float]:
        """The accumulated step's modeled `(step time, peak memory)`: `accumulated_step`
        and the one-micro-batch program's peak."""
        one, again, peak = self.pair[0].accumulation_parts()
        two = self.pair[1].evaluate_parts()[0]
        return accumulated_step(one, two, self.grad_accum, self.pair[0].device, again), peak

    def exact_peak(self) -> float:
        """The exact modeled peak memory of the one-micro-batch program."""
        return self.pair[0].exact_peak()

    def compute_time(self) -> float:
        """The accumulated step's modeled compute time."""
        c1, c2 = (s.compute_time() for s in self.pair)
        return c1 + (self.grad_accum - 1) * (c2 - c1)

    def mismatch(self, part, actions) -> str | None:
        """The one-micro-batch state's verdict on the program's plan (see `TwinState`)."""
        return self.pair[0].mismatch(part, actions)

    def describe(self) -> str:
        """What is searched, for the history."""
        return (f"{self.pair[0].describe()}; priced over {self.grad_accum} micro-batches a step from the "
                "program on one and on two micro-batches, term by term, FSDP's parameter gathers and gradient "
                "reduce-scatters every micro-batch")


def two_micro_batches(part, where: str):
    """`part`'s decisions on the same train step traced on two micro-batches (every
    batch input's leading dim doubled), or a `TacticError` naming why it cannot be."""
    prog = part.program
    origin = prog.origin
    if origin is None:
        raise TacticError(f"{where}: pricing gradient accumulation traces the step on two micro-batches, but the "
                          "program was not lifted from a function; use grad_accum=1 or lift it with partir.lift")
    dyn = [i for i in range(len(origin.args)) if i not in origin.static_argnums]
    leaves, tree = jax.tree_util.tree_flatten([origin.args[i] for i in dyn])
    if len(leaves) != len(prog.inputs):
        raise TacticError(f"{where}: the program's inputs do not match its arguments, so its batch cannot be "
                          "doubled for the step of two micro-batches; use grad_accum=1")
    batch = set(roles(prog).batch)
    doubled = [jax.ShapeDtypeStruct((2 * x.shape[0], *x.shape[1:]), x.dtype) if v in batch
               else jax.ShapeDtypeStruct(x.shape, x.dtype) for v, x in zip(prog.inputs, leaves)]
    args = list(origin.args)
    for i, a in zip(dyn, jax.tree_util.tree_unflatten(tree, doubled)):
        args[i] = a
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the program already warned about whatever this one would
        other = lift(origin.fn, *args, static_argnums=origin.static_argnums)
    if (len(other.ops), len(other.values), other.input_names) != (len(prog.ops), len(prog.values), prog.input_names):
        raise TacticError(f"{where}: the step on two micro-batches is not the same program on a larger batch "
                          "(its ops or inputs differ), so its cost is not affine in the micro-batches; "
                          "use grad_accum=1")
    two = Partitioning(other, part.mesh, detached=part.detached)
    try:
        for d in part.decisions:
            two.redo(d)
    except PartitioningError as e:
        raise TacticError(f"{where}: earlier decisions do not replay on the step of two micro-batches ({e})") from e
    moved = [prog.name(v) for v in prog.inputs if two.tiling(v) != part.tiling(v)]
    if moved:
        raise TacticError(f"{where}: earlier decisions lay out {', '.join(moved[:3])} otherwise on the step of two "
                          "micro-batches; use grad_accum=1")
    return two
