"""Activation rematerialization as a tactic."""

from __future__ import annotations

from dataclasses import dataclass

import partir
from partir import REMAT_POLICIES, path_matches

from . import _checks as check
from ._base import Context, Tactic, TacticError


@dataclass(frozen=True)
class Remat(Tactic):
    """Recompute activations in the backward pass instead of keeping them, as
    `jax.checkpoint` does, for every layer (`partir.layers`: a scan's body, the layers
    of an unrolled model) whose parameters match `pattern` (a glob on `/`-joined keys or
    a `re:` regex on input names; every layer when None).

    `policy` says what each layer keeps: `full` (only its input activation: the layer runs
    twice), `dots` (also its matmul outputs), `collectives` (also whatever an op made after
    moving data between devices, so recomputing repeats no communication),
    `dots_with_context` (what `dots` keeps and the attention's output, MaxText's
    `minimal_with_context`: only elementwise work and norms run again, a fused attention
    kernel none), `dots_except_mlp_in` (the outputs of every matmul but the MLP's up and
    gate projections, MaxText's `save_dot_except_mlpwi`), `dots_except_mlp` (the attention's
    query, key, value and output projections' outputs, MaxText's `save_dot_except_mlp`),
    `every_other_dot` (the outputs of the first, third, fifth... projection in program order
    and the attention's output, torchtitan's selective op checkpointing), `qkv` (the
    attention's query, key and value projections' outputs only, MaxText's `save_qkv_proj`),
    `none` (everything: no recomputation). The matmuls' roles are read from the dataflow
    (`partir.dot_roles`), never from names. What is not kept is recomputed from what is,
    just before the backward pass reads it; the lowering keeps XLA from merging the
    recomputation back into the forward pass.

    On a layer the user wrapped in `jax.checkpoint`, the policy replaces the user's: it
    *tightens* the checkpoint where it keeps less (the values the user's policy saved
    are recomputed too), *relaxes* it where it keeps more (the backward region reads
    the forward values it would recompute, `Partitioning.reuse`), both where it keeps
    some values the user's does not and drops others, and *keeps* it where it keeps the
    same. The history note says which.
    """

    policy: str = "full"
    pattern: str | None = None

    def __post_init__(self):
        check.one_of("Remat policy", self.policy, REMAT_POLICIES, error=TacticError)
        if self.pattern is not None:
            check.pattern("Remat pattern", self.pattern, error=TacticError)

    def apply(self, part, ctx: Context):
        prog = part.program
        if self.pattern is not None:
            check.warn_alike_paths("Remat pattern", self.pattern, prog, prog.match_inputs(self.pattern))
        layers = partir.remat_layers(prog)
        if not layers:
            raise TacticError("found no layers to rematerialize (a scan over layers in the forward pass, or a list "
                              "of alike layers in the arguments): write the layers so, or leave Remat out")
        chosen = [b for b in layers if self.pattern is None or any(
            v in prog.input_set and path_matches(self.pattern, prog.name(v)) for v in b.inputs)]
        if not chosen:
            raise TacticError(f"pattern {self.pattern!r} matches the parameters of no layer; layers read e.g. "
                              f"{sorted(prog.name(v) for v in layers[0].inputs if v in prog.input_set)[:3]}")
        if part.pipelines and any(partir.reusable(prog, layer, self.policy, part) for layer in chosen):
            raise TacticError(f"policy {self.policy!r} relaxes the user's jax.checkpoint, which pipelined layers do "
                              "not do yet: pick a policy that keeps no more than the user's, or leave Remat out")
        count, users, source = 0, {}, str(self)
        for layer in chosen:
            recomputed = partir.recomputed(prog, layer, self.policy, part)
            reused = partir.reusable(prog, layer, self.policy, part)
            for r in recomputed:
                part.remat(r, source=source)
            for v in partir.saved_dots(prog, layer, self.policy) if recomputed else ():
                part.save(v, source=source)
            for w, _ in reused:
                part.reuse(w, source=source)
            count += len(recomputed)
            ckpts = partir.checkpoints_of(prog, layer)
            if ckpts:
                # (A policy keeping other values than the user's does both: 'every_other_dot'
                # over 'dots' recomputes some projections and reads the attention's output.)
                did = (("tightened", recomputed), ("relaxed", reused))
                verdict = " and ".join(w for w, done in did if done) or "kept"
                name = "/".join(sorted({c.policy_name for c in ckpts}))
                users.setdefault((name, verdict), []).append(len(reused))
        again = partir.recompute(prog, part.rematerialized, part.saved).ops if part.rematerialized else ()
        kept = sum(len(b.residuals) for b in chosen) - count
        notes = [f"policy {self.policy!r} on {len(chosen)} layer(s): {count} residual(s) recomputed in the backward "
                 f"pass, {kept} kept; {sum(1 for o in again if not prog.ops[o].link)} forward op(s) run again"]
        for (name, verdict), reused in users.items():
            notes.append(f"the user's jax.checkpoint (policy {name!r}) on {len(reused)} layer(s): {verdict}"
                         + (f", {sum(reused)} recomputed value(s) read from the forward pass instead"
                            if verdict.endswith("relaxed") else ""))
        return part, notes
