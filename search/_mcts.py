"""Monte Carlo tree search over tiling actions, as in Automap.

A state is a partitioning; an action tiles one group of inputs (and propagation does
the rest), applies a whole tactic (a macro action), or stops. Each episode walks down
the tree from the root by UCT,

    choose argmax_a  Q(s, a) + C_UCT * sqrt(ln N(s) / N(s, a)),

expands one untried action (macros first), finishes with a short random rollout, and
scores the state it ends in with the cost model:

    feasible (peak memory <= limit):  reward = 1/2 + 1/2 * exp(-K_REWARD * (t / t_ideal - 1))
    infeasible:                       reward = 1/2 * limit / peak

where `t_ideal` is the root plan's compute time divided by the number of devices the
search decides over (perfectly split work, no communication): every plan that fits
scores above every plan that does not, faster plans score higher, and plans a few
percent apart near the ideal stay well apart. The problem is deterministic and the search wants its
best plan, not its average one, so Q(s, a) is the best reward seen below the action
(max backup).

When the tree search stalls (`POLISH_AFTER` episodes without a better plan), its best
plan is polished by hill climbing: the single action (or macro) appended to it, or the
single tile put before it, that improves it most is taken, again and again until none
does; then the tree search goes on. States are nodes of a transposition table keyed by the partitioning's hash, so
action orders that reach the same plan share statistics. The search stops at its time
budget, at `max_episodes`, or when the best plan has not improved for `patience`
episodes; it returns the best plan seen. All randomness comes from `seed`: with the same
seed a search that stops by episodes or convergence makes the same plan.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from ._actions import STOP, Action

#: Exploration constant of UCT. Rewards lie in [0, 1] and good plans differ by a few
#: hundredths, so exploration is kept small beside the usual sqrt(2)/2: the search
#: refines the best branches and still revisits the others as their counts fall behind.
C_UCT = 0.1
#: Sharpness of the reward around the ideal step time: a plan 10% above the ideal
#: scores 0.5 + 0.5 * exp(-0.2), one 20% above 0.5 + 0.5 * exp(-0.4).
K_REWARD = 2.0
#: How many runner-up plans the result keeps (for explanations), chosen among the
#: TOP_KEPT best distinct plans seen.
TOP_PLANS = 3
TOP_KEPT = 32
#: Episodes without a better plan before the best plan is polished by hill climbing.
POLISH_AFTER = 60
#: Longest random rollout after an expansion, in actions.
ROLLOUT_DEPTH = 2
#: Probability that a rollout step stops instead of acting.
ROLLOUT_STOP = 0.5
#: Probability that a rollout step applies a macro action (when macros are offered).
ROLLOUT_MACRO = 0.5


@dataclass
class SearchStats:
    """How a search went: episodes run, distinct states, evaluations answered from the
    cache, wall time, why it stopped, and the best modeled step time over time as
    `(seconds, episode, step time)` whenever it improved."""

    episodes: int = 0
    states: int = 0
    cache_hits: int = 0
    evaluations: int = 0
    elapsed: float = 0.0
    stopped: str = ""
    trace: list = field(default_factory=list)


@dataclass
class SearchResult:
    """The best plan found: its actions (in order), modeled step time and peak memory,
    whether it fits, the search statistics, and the runners-up it rejected."""

    actions: tuple[Action, ...]
    step_time: float
    memory_peak: float
    fits: bool
    root_step_time: float
    stats: SearchStats
    alternatives: tuple = ()  # the next best distinct plans seen: (actions, step time, peak)


class _Node:
    __slots__ = ("visits", "value", "untried", "children")

    def __init__(self):
        self.visits = 0
        self.value = 0.0  # the best reward backed up through this node
        self.untried = None
        self.children: dict[Action, tuple] = {}


def mcts(state, *, budget_s: float, seed: int = 0, memory_limit: float | None = None,
         max_episodes: int | None = None, patience: int | None = None, macros=(), progress=None,
         start: float | None = None) -> SearchResult:
    """Search for the best sequence of actions from `state`'s current point (a
    `SearchState`, or a `TwinState`); `state` is left as it was. Times (the budget, the
    trace) count from `start` (a `time.perf_counter()` reading; now by default), so a
    caller can include its own set-up."""
    rng = random.Random(seed)
    limit = state.memory_limit if memory_limit is None else memory_limit
    start = time.perf_counter() if start is None else start
    stats = SearchStats()
    cache: dict[int, tuple[float, float]] = {}

    def evaluate() -> tuple[float, float]:
        key = state.key()
        hit = cache.get(key)
        if hit is not None:
            stats.cache_hits += 1
            return hit
        stats.evaluations += 1
        cache[key] = hit = state.evaluate()
        return hit

    t_root, _ = evaluate()

    t_ideal = state.compute_time() / math.prod(state.mesh.size(a) for a in state.axes)

    def reward(t, peak):
        if peak > limit:
            return 0.5 * limit / peak
        return 0.5 + 0.5 * math.exp(-K_REWARD * max(0.0, t / t_ideal - 1.0))

    def actions_here():
        # Macros last in the list: they are popped first, in reverse order.
        return [STOP] + state.actions() + [Action.macro(m) for m in reversed(macros)]

    root_key = state.key()
    tree: dict[int, _Node] = {root_key: _Node()}
    t0, m0 = evaluate()
    best = (reward(t0, m0), (), t0, m0)
    stats.trace.append((0.0, 0, t0))
    patience = patience if patience is not None else max(1000, 30 * len(actions_here()))
    since_best = 0
    top: dict[int, tuple] = {}  # the best distinct plans by state: (reward, actions, time, peak)

    def remember(r, actions, t, peak) -> None:
        key = state.key()
        if key not in top or top[key][0] < r:
            top[key] = (r, tuple(actions), t, peak)
            if len(top) > 2 * TOP_KEPT:
                for k in sorted(top, key=lambda k: top[k][0])[:len(top) - TOP_KEPT]:
                    del top[k]

    held: list[tuple[Action, int]] = []  # the tree path currently applied, with undo marks
    polished: set = set()  # best plans (action tuples) already hill-climbed from

    def seed_path(seq) -> None:
        """Walk `seq` from the root as the tree would (creating its nodes), score where
        it ends and back the reward up: the macro pairs are seeded so, in order."""
        nonlocal best
        mark = state.mark()
        key, node, path, applied = root_key, tree[root_key], [tree[root_key]], []
        for a in seq:
            if node.untried is None:
                node.untried = actions_here()
            if a in node.children:
                if not state.apply(a):
                    break
            else:
                if a not in node.untried or not state.apply(a):
                    break
                node.untried.remove(a)
            applied.append(a)
            key = state.key()
            node.children[a] = key
            node = tree.setdefault(key, _Node())
            path.append(node)
        t, peak = evaluate()
        r = reward(t, peak)
        remember(r, applied, t, peak)
        for n in path:
            n.visits += 1
            n.value = max(n.value, r)
        stats.episodes += 1
        if r > best[0] + 1e-12:
            best = (r, tuple(applied), t, peak)
            stats.trace.append((time.perf_counter() - start, stats.episodes, t))
        state.rollback(mark)

    # Every pair of macro actions first: two tactics on two axes are the textbook plans
    # (data parallel + Megatron, FSDP + Megatron, ...), and this costs len(macros)**2.
    # Singles first, then pairs starting from the best singles.
    macro_actions = [Action.macro(m) for m in macros]
    for first in macro_actions:
        seed_path([first])
    root = tree[root_key]
    ranked = sorted(macro_actions, key=lambda a: -tree[root.children[a]].value if a in root.children else 0.0)
    for first in ranked:
        for second in ranked:
            if second != first and time.perf_counter() - start < budget_s:
                seed_path([first, second])

    while True:
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            stats.stopped = "time budget"
            break
        if max_episodes is not None and stats.episodes >= max_episodes:
            stats.stopped = "episode limit"
            break
        if since_best >= patience:
            stats.stopped = f"converged (no better plan in {patience} episodes)"
            break
        key = root_key
        node, path, applied = tree[key], [tree[key]], []
        stopped = False
        while True:
            if node.untried is None:
                node.untried = actions_here()
            if node.untried:
                # Macro actions (whole tactics) are tried before single tiles: they reach
                # the textbook plans in one step, which then anchor the search.
                last = node.untried[-1]
                a = node.untried.pop() if last.kind == "macro" else node.untried.pop(rng.randrange(len(node.untried)))
                expanding = True
            elif node.children:
                a = _uct(node, tree)
                expanding = False
            else:
                break  # no action left here at all
            if a == STOP:
                # "Stop here" is a leaf of its own, so UCT learns how good stopping is.
                skey = ("stop", key)
                node.children[STOP] = skey
                path.append(tree.setdefault(skey, _Node()))
                stopped = True
                break
            # Episodes mostly retrace the previous one's path: keep what is applied up to
            # where they part, and undo only the rest.
            depth = len(applied)
            if depth < len(held) and held[depth][0] == a:
                applied.append(a)
            else:
                if depth < len(held):
                    state.rollback(held[depth][1])
                    del held[depth:]
                mark = state.mark()
                if not state.apply(a):
                    node.children.pop(a, None)
                    continue
                held.append((a, mark))
                applied.append(a)
            key = state.key()
            child = tree.get(key)
            if child is None:
                child = tree[key] = _Node()
            else:
                stats.cache_hits += 1
            node.children[a] = key
            node = child
            path.append(node)
            if expanding:
                break
        if len(held) > len(applied):
            state.rollback(held[len(applied)][1])
            del held[len(applied):]
        rollout_mark = state.mark()
        rollout = []
        if not stopped:
            for _ in range(ROLLOUT_DEPTH):
                if rng.random() < ROLLOUT_STOP:
                    break
                # Half the rollout steps apply a whole tactic: with max backup, one good
                # completion lifts a branch whose single tiles alone look poor.
                if macros and rng.random() < ROLLOUT_MACRO:
                    a = Action.macro(macros[rng.randrange(len(macros))])
                else:
                    acts = state.actions()
                    if not acts:
                        break
                    a = acts[rng.randrange(len(acts))]
                if state.apply(a):
                    rollout.append(a)
        t, peak = evaluate()
        r = reward(t, peak)
        remember(r, applied + rollout, t, peak)
        for n in path:
            n.visits += 1
            if r > n.value:
                n.value = r
        stats.episodes += 1
        since_best += 1
        if r > best[0] + 1e-12:
            best = (r, tuple(applied + rollout), t, peak)
            since_best = 0
            stats.trace.append((time.perf_counter() - start, stats.episodes, t))
        state.rollback(rollout_mark)
        if since_best >= POLISH_AFTER and best[1] not in polished:
            polished.add(best[1])
            if held:
                state.rollback(held[0][1])
                held.clear()
            better = _polish(state, macros, best, reward, evaluate, deadline=start + budget_s)
            if better is not None:
                best = better
                since_best = 0
                stats.trace.append((time.perf_counter() - start, stats.episodes, best[2]))
        if progress is not None and stats.episodes % 16 == 0:
            progress(stats.episodes, best[2], time.perf_counter() - start)
    if held:
        state.rollback(held[0][1])
    stats.states = len(tree)
    stats.elapsed = time.perf_counter() - start
    if progress is not None:
        progress(stats.episodes, best[2], stats.elapsed)
    # Runners-up: the best plans built from other tactics than the best one's (a
    # different set of macro actions), else any other plans, best first.
    def macro_set(actions):
        return frozenset(a for a in actions if a.kind == "macro")

    others = [v for v in top.values() if v[1] != best[1] and v[2] > best[2] * (1 + 1e-9)]
    distinct = [v for v in others if macro_set(v[1]) != macro_set(best[1])]
    runners = sorted(distinct or others, key=lambda v: -v[0])[:TOP_PLANS]
    return SearchResult(best[1], best[2], best[3], best[3] <= limit, t_root, stats,
                        tuple((a, t, p) for _, a, t, p in runners))


def _polish(state, macros, best, reward, evaluate, *, deadline: float):
    """Hill-climb from the best plan; a better `(reward, actions, time, peak)` or None.
    `state` must be at the root; it is left there.

    Each round tries every single action appended to the plan, then every single tile
    put *before* it (decisions are ordered: an early tile can change what a later
    tactic does, e.g. a vocabulary-split embedding that FSDP would otherwise gather),
    and keeps the best improvement; it stops when a round improves nothing."""
    root = state.mark()
    current, improved = best, False

    def score(seq):
        mark = state.mark()
        ok = all(state.apply(a) for a in seq)
        t, peak = evaluate() if ok else (math.inf, math.inf)
        state.rollback(mark)
        return (reward(t, peak), tuple(seq), t, peak) if ok else None

    while time.perf_counter() < deadline:
        seq = list(current[1])
        candidates = []
        for a in seq:
            state.apply(a)
        for a in state.actions() + [Action.macro(m) for m in macros]:
            candidates.append(seq + [a])
        state.rollback(root)
        candidates += [[a] + seq for a in state.actions() if a not in seq]
        top = None
        for cand in candidates:
            if time.perf_counter() >= deadline:
                break
            scored = score(cand)
            if scored is not None and scored[0] > current[0] + 1e-12 and (top is None or scored[0] > top[0]):
                top = scored
        if top is None:
            break
        current, improved = top, True
    state.rollback(root)
    return current if improved else None


def _uct(node: _Node, tree) -> Action:
    log_n = math.log(max(1, node.visits))
    best, best_score = None, -1.0
    for a, key in node.children.items():
        child = tree[key]
        if child.visits == 0:
            score = math.inf
        else:
            score = child.value + C_UCT * math.sqrt(log_n / child.visits)
        if score > best_score:
            best, best_score = a, score
    return best
