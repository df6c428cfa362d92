"""What the tree search (`_mcts.TreeSearch`, here `search`) does to its best plan
beside the tree: hill climbing when it stalls (`polish`, over the plans one action away:
`neighbours`), and once it ends, the remat policies the tree does not offer in place of
its plan's (`refine_remat`). Each takes the state at the root and leaves it there, and
returns a better scored plan or None."""

from __future__ import annotations

import time

from tactics import Remat

from ._actions import Action
from ._seeds import REMAT_REFINED


def polish(search):
    """Hill-climb from the best plan; a better plan or None. The state must be at the
    root; it is left there.

    Each round tries every single action appended to the plan, then every single tile
    put *before* it (decisions are ordered: an early tile can change what a later
    tactic does, e.g. a vocabulary-split embedding that FSDP would otherwise gather),
    and keeps the best improvement; it stops when a round improves nothing."""
    root = search.state.mark()
    current, improved = search.best, False
    while time.perf_counter() < search.deadline:
        top = None
        for cand in neighbours(search, current.actions, root):
            if time.perf_counter() >= search.deadline:
                break
            mark = search.state.mark()
            if all(search.state.apply(a) for a in cand):
                scored = search.score(cand)
                if scored.reward > current.reward + 1e-12 and (top is None or scored.reward > top.reward):
                    top = scored
            search.state.rollback(mark)
        if top is None:
            break
        current, improved = top, True
    search.state.rollback(root)
    return current if improved else None


def refine_remat(search):
    """The best plan with its remat policy swapped for each of `REMAT_REFINED` (the
    policies that keep some matmuls by their role, between 'full' and 'dots', and
    'dots_with_context' past 'dots'), if one scores better; else None. They are not
    macros of the tree search: seeded beside 'dots' and 'full', they took the budget of
    a four-axis mesh's compositions and the search ended above the plan it reaches
    without them. Once the plan is chosen, a policy between the two is how a run spends
    the memory the plan leaves on keeping matmuls (MaxText's Llama 3 70B keeps its q, k,
    v projections). The state must be at the root; it is left there."""
    root, top = search.state.mark(), None
    for i, a in enumerate(search.best.actions):
        if a.kind != "macro" or not isinstance(a.tactic, Remat) or a.tactic.pattern is not None:
            continue
        for policy in REMAT_REFINED:
            cand = (*search.best.actions[:i], Action.macro(Remat(policy)), *search.best.actions[i + 1:])
            if cand[i] == a:
                continue
            if all(search.state.apply(x) for x in cand):
                scored = search.score(cand)
                if scored.reward > max(search.best.reward, top.reward if top else 0.0) + 1e-12:
                    top = scored
            search.state.rollback(root)
    return top


def neighbours(search, actions, root) -> list[list[Action]]:
    """The plans one action away from `actions` (from the root state `root`): each
    action or macro appended, each tile not in it put first, each macro in it swapped
    for another (a remat policy for a lighter one, FSDP for data parallel: a seeded
    sequence can hold the wrong member of a family that only a swap reaches), each
    action dropped."""
    seq = list(actions)
    for a in seq:
        search.state.apply(a)
    out = [seq + [a] for a in search.state.actions() + list(search.macros)]
    search.state.rollback(root)
    out += [[a] + seq for a in search.state.actions() if a not in seq]
    out += [[*seq[:i], m, *seq[i + 1:]] for i, a in enumerate(seq) if a.kind == "macro" for m in search.macros
            if m not in seq]
    return out + [[*seq[:i], *seq[i + 1 :]] for i in range(len(seq))]
