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

`TreeSearch` holds the tree, the transposition table, the statistics and the best plans;
its steps are methods by name: `seed_macros`, then per episode `select` (UCT among tried
actions) and `expand` (one untried action) on the way down, `rollout`, `evaluate`,
`backup`, and now and then `_refine.polish`; `run` loops until a stopping rule holds,
then tries the best plan under the remat policies the tree does not offer
(`_refine.refine_remat`).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from . import _refine, _seeds
from ._actions import STOP, Action
from ._result import SearchResult, SearchStats

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
#: Macro sequences kept at each step of the seeding beam, and the longest sequence it
#: builds (see `TreeSearch.seed_macros`).
BEAM = 4
MACRO_DEPTH = 5
#: Most of the time budget the ordered pairs of macros and the compositions (`seeds`)
#: may take: the rest is left to the beam and the tree search, which refine what they
#: found. Four mesh axes offer more of them than a 30 s budget scores (see
#: `_seeds.primary_first`).
SEED_SHARE = 0.5
#: Times one walk may come back to a state it passed (by actions that change nothing)
#: before it ends there: a few, as UCT takes such edges while their bonus lasts; not
#: without end (a walk that kept taking one ran out of memory).
WALK_REVISITS = 4
#: Episodes without a better plan before the best plan is polished by hill climbing.
POLISH_AFTER = 60
#: Longest random rollout after an expansion, in actions.
ROLLOUT_DEPTH = 2
#: Probability that a rollout step stops instead of acting.
ROLLOUT_STOP = 0.5
#: Probability that a rollout step applies a macro action (when macros are offered).
ROLLOUT_MACRO = 0.5


class _Node:
    __slots__ = ("visits", "value", "untried", "children")

    def __init__(self):
        self.visits = 0
        self.value = 0.0  # the best reward backed up through this node
        self.untried = None
        self.children: dict[Action, tuple] = {}


class _Scored(NamedTuple):
    """A plan and its score."""

    reward: float
    actions: tuple[Action, ...]
    time: float
    peak: float


@dataclass
class _Walk:
    """One episode's way down the tree: the key of the node it is at, the nodes passed
    (backed up into), the actions applied, and whether it ended by stopping."""

    key: object
    path: list
    applied: list = field(default_factory=list)
    stopped: bool = False
    seen: dict = field(default_factory=dict)  # state key -> times the walk passed it


class TreeSearch:
    """The tree search (see the module docstring) from `state`'s current point, which
    it leaves as it was: the tree of `_Node`s by state key (a transposition table), the
    evaluation cache, the statistics, the best plan and the best distinct plans seen.
    Times count from `start` (a `time.perf_counter()` reading); `macros` are tactics
    offered as single actions; `progress(episodes, best step time, elapsed)` is called
    every 16 episodes and at the end."""

    def __init__(self, state, *, budget_s: float, seed: int, macros, start: float, max_episodes: int | None,
                 patience: int | None, progress, seeds=()):
        self.state, self.rng = state, random.Random(seed)
        self.macros = tuple(Action.macro(m) for m in macros)
        self.seeds = tuple(tuple(seq) for seq in seeds)
        self.limit = state.memory_limit
        self.start, self.budget_s, self.deadline = start, budget_s, start + budget_s
        self.max_episodes, self.progress = max_episodes, progress
        self.stats = SearchStats()
        self.cache: dict[int, tuple[float, float]] = {}
        t, peak = self.evaluate()
        self.root_time = t
        # A program that computes nothing (an identity) still needs a scale: 1 fs.
        self.t_ideal = max(state.compute_time() / state.mesh.devices_along(state.axes), 1e-15)
        self.root_key = state.key()
        self.tree: dict[object, _Node] = {self.root_key: _Node()}
        self.best = _Scored(self.reward(t, peak), (), t, peak)
        self.stats.trace.append((0.0, 0, t))
        self.patience = patience if patience is not None else max(1000, 30 * len(self.actions_here()))
        self.since_best = 0
        self.top: dict[int, _Scored] = {}  # the best distinct plans, by state key
        self.held: list[tuple[Action, object]] = []  # the tree path now applied, with undo marks
        self.polished: set = set()  # best plans (action tuples) already hill-climbed from

    # -- scoring ---------------------------------------------------------------------
    def evaluate(self) -> tuple[float, float]:
        """Modeled `(step time, peak memory)` of the state, each state costed once."""
        key = self.state.key()
        hit = self.cache.get(key)
        if hit is not None:
            self.stats.cache_hits += 1
            return hit
        self.stats.evaluations += 1
        self.cache[key] = hit = self.state.evaluate()
        self.stats.min_peak = min(self.stats.min_peak, hit[1])
        return hit

    def reward(self, t: float, peak: float) -> float:
        """The objective of the module docstring."""
        if peak > self.limit:
            return 0.5 * self.limit / peak
        return 0.5 + 0.5 * math.exp(-K_REWARD * max(0.0, t / self.t_ideal - 1.0))

    def score(self, actions) -> _Scored:
        """The current state, reached by `actions`, scored."""
        t, peak = self.evaluate()
        return _Scored(self.reward(t, peak), tuple(actions), t, peak)

    def remember(self, scored: _Scored) -> None:
        """Keep `scored` (the current state's plan) among the best distinct plans."""
        key = self.state.key()
        if key not in self.top or self.top[key].reward < scored.reward:
            self.top[key] = scored
            if len(self.top) > 2 * TOP_KEPT:
                for k in sorted(self.top, key=lambda k: self.top[k].reward)[:len(self.top) - TOP_KEPT]:
                    del self.top[k]

    def improve(self, scored: _Scored) -> bool:
        """Take `scored` as the best plan if it is better; whether it was."""
        if scored.reward <= self.best.reward + 1e-12:
            return False
        self.best = scored
        self.stats.trace.append((time.perf_counter() - self.start, self.stats.episodes, scored.time))
        return True

    def backup(self, path, reward: float) -> None:
        """Count a visit to every node on `path` and raise its value to `reward` (max
        backup: the best plan below a node is what it is worth)."""
        for n in path:
            n.visits += 1
            if reward > n.value:
                n.value = reward

    # -- the tree --------------------------------------------------------------------
    def actions_here(self) -> list[Action]:
        """The actions of a new node: stop, the tiles, then the macros (last: they are
        popped first, in reverse order)."""
        return [STOP] + self.state.actions() + list(reversed(self.macros))

    def select(self, node: _Node) -> Action:
        """UCT among the actions tried at `node`: unvisited children first, then the
        best value plus the exploration bonus."""
        log_n = math.log(max(1, node.visits))
        best, best_score = None, -1.0
        for a, key in node.children.items():
            child = self.tree[key]
            if child.visits == 0:
                score = math.inf
            else:
                score = child.value + C_UCT * math.sqrt(log_n / child.visits)
            if score > best_score:
                best, best_score = a, score
        return best

    def expand(self, node: _Node) -> Action:
        """Take an untried action of `node`: a macro if any is left (whole tactics reach
        the textbook plans in one step, which then anchor the search), else one at
        random."""
        if node.untried[-1].kind == "macro":
            return node.untried.pop()
        return node.untried.pop(self.rng.randrange(len(node.untried)))

    def follow(self, action: Action, depth: int) -> bool:
        """Have `action` applied as the `depth`-th step of the walk; False if it does not
        apply. Episodes mostly retrace the previous one's path: what is applied up to
        where they part is kept, and only the rest undone."""
        held = self.held
        if depth < len(held) and held[depth][0] == action:
            return True
        if depth < len(held):
            self.state.rollback(held[depth][1])
            del held[depth:]
        mark = self.state.mark()
        if not self.state.apply(action):
            return False
        held.append((action, mark))
        return True

    def release(self, depth: int) -> None:
        """Undo the held path below its first `depth` actions."""
        if len(self.held) > depth:
            self.state.rollback(self.held[depth][1])
            del self.held[depth:]

    def descend(self) -> _Walk:
        """Walk down from the root: `select` while a node's actions are all tried,
        `expand` one untried action and end there, or end at a stop (a leaf of its own,
        so UCT learns how good stopping is) or where no action is left."""
        walk = _Walk(self.root_key, [self.tree[self.root_key]], seen={self.root_key: 1})
        node = walk.path[0]
        while True:
            if node.untried is None:
                node.untried = self.actions_here()
            if node.untried:
                a, expanding = self.expand(node), True
            elif node.children:
                a, expanding = self.select(node), False
            else:
                break
            if a == STOP:
                node.children[STOP] = ("stop", walk.key)
                walk.path.append(self.tree.setdefault(("stop", walk.key), _Node()))
                walk.stopped = True
                break
            if not self.follow(a, len(walk.applied)):
                node.children.pop(a, None)
                continue
            key = self.state.key()
            if walk.seen.get(key, 0) >= WALK_REVISITS:
                # An action that changed nothing leads back to a state this walk passed:
                # UCT may take such an edge again and again, and the walk would never end.
                self.release(len(walk.applied))
                node.children.pop(a, None)
                break
            walk.seen[key] = walk.seen.get(key, 0) + 1
            walk.applied.append(a)
            walk.key = key
            child = self.tree.get(walk.key)
            if child is None:
                child = self.tree[walk.key] = _Node()
            else:
                self.stats.cache_hits += 1
            node.children[a] = walk.key
            node = child
            walk.path.append(node)
            if expanding:
                break
        self.release(len(walk.applied))
        return walk

    def rollout(self) -> list[Action]:
        """A short random completion from the current state; the actions that applied.
        Half its steps apply a whole tactic: with max backup, one good completion lifts
        a branch whose single tiles alone look poor."""
        done = []
        for _ in range(ROLLOUT_DEPTH):
            if self.rng.random() < ROLLOUT_STOP:
                break
            if self.macros and self.rng.random() < ROLLOUT_MACRO:
                a = self.macros[self.rng.randrange(len(self.macros))]
            else:
                acts = self.state.actions()
                if not acts:
                    break
                a = acts[self.rng.randrange(len(acts))]
            if self.state.apply(a):
                done.append(a)
        return done

    def episode(self) -> None:
        """One episode: descend, roll out, score, back up; then polish the best plan if
        the search has stalled, and report progress."""
        walk = self.descend()
        mark = self.state.mark()
        rollout = [] if walk.stopped else self.rollout()
        scored = self.score(walk.applied + rollout)
        self.remember(scored)
        self.backup(walk.path, scored.reward)
        self.stats.episodes += 1
        self.since_best += 1
        if self.improve(scored):
            self.since_best = 0
        self.state.rollback(mark)
        if self.since_best >= POLISH_AFTER and self.best.actions not in self.polished:
            self.polished.add(self.best.actions)
            self.release(0)
            better = _refine.polish(self)
            if better is not None and self.improve(better):
                self.since_best = 0
        if self.progress is not None and self.stats.episodes % 16 == 0:
            self.progress(self.stats.episodes, self.best.time, time.perf_counter() - self.start)

    # -- seeding -------------------------------------------------------------------
    def seed_path(self, seq, dead: set | None = None) -> _Scored:
        """Walk `seq` from the root as the tree would (creating its nodes), score where
        it ends, back the reward up and return it; its dead end to `dead` (`_seeds.dead_end`)."""
        mark = self.state.mark()
        node, path, applied = self.tree[self.root_key], [self.tree[self.root_key]], []
        for a in seq:
            if node.untried is None:
                node.untried = self.actions_here()
            if a not in node.children and a not in node.untried:
                break
            if not self.state.apply(a):
                break
            if a in node.untried:
                node.untried.remove(a)
            applied.append(a)
            node.children[a] = key = self.state.key()
            node = self.tree.setdefault(key, _Node())
            path.append(node)
        if dead is not None and len(applied) < len(seq):
            dead.add(tuple(a.tactic for a in seq[:len(applied) + 1]))
        scored = self.score(applied)
        self.remember(scored)
        self.backup(path, scored.reward)
        self.stats.episodes += 1
        self.improve(scored)
        self.state.rollback(mark)
        return scored

    def seed_macros(self) -> None:
        """Seed every macro action, then every ordered pair of them and the longer plans
        of `seeds` (`search._seeds.compositions`: one role per mesh axis, as the plans
        people run at scale compose four or five tactics): first one variant of each
        assignment of roles to axes (`_seeds.skeletons`, those using every axis first;
        `seed_skeleton`), then the other variants, each role's best variant first
        (`_seeds.primary_first`), but those that begin with a dead end
        (`_seeds.dead_end`), in at most SEED_SHARE of the time budget. Then a beam from
        all of them: the BEAM best sequences and the BEAM fastest are extended by every
        other macro, up to MACRO_DEPTH of them."""
        dead: set = set()  # sequences of tactics whose last did not apply: dead ends
        for a in self.macros:
            if self.room():
                self.seed_path([a], dead)
        root = self.tree[self.root_key]
        # By reward, then speed: variants that do not fit tie on reward (it reads the peak).
        scored = {a.tactic: (self.tree[k].value, -self.cache[k][0]) if (k := root.children.get(a)) is not None
                  else (0.0, -math.inf) for a in self.macros}
        ranked = sorted(self.macros, key=lambda a: scored[a.tactic], reverse=True)
        pairs = [(first.tactic, second.tactic) for first in ranked for second in ranked if second != first]
        seeds = [*pairs, *self.seeds]
        seed_until = self.start + SEED_SHARE * self.budget_s
        axes = [a for a in self.state.axes if self.state.mesh.size(a) > 1]
        beam, seeded, groups = [], set(), _seeds.skeletons(seeds, scored.get, axes)
        self.stats.assignments = (0, len(groups))
        for n, variants in enumerate(groups):
            if not (self.room() and time.perf_counter() < seed_until):
                break
            beam += self.seed_skeleton(variants, dead, seeded)
            self.stats.assignments = (n + 1, len(groups))
        beam += [self.seed_path([Action.macro(t) for t in seq], dead)
                 for seq in _seeds.primary_first([s for s in seeds if s not in seeded], scored.get)
                 if self.room() and time.perf_counter() < seed_until and not _seeds.dead_end(seq, dead)]
        self.grow_beam(beam)

    def seed_skeleton(self, variants, dead: set, seeded: set) -> list[_Scored]:
        """Seed the first of `variants` (one assignment of roles to axes, likeliest best
        first) that applies whole: one whose tactic did not apply (a pipeline's microbatch
        count the data roles leave no room for) gives way to the next without it. One
        that does not fit is followed by its variants with a remat policy (a fast plan
        is one remat away from fitting). Returns what was scored; adds to `seeded`."""
        out, failed = [], set()
        for seq in variants:
            if _seeds.dead_end(seq, dead) or not failed.isdisjoint(seq):
                continue
            out.append(self.seed_path([Action.macro(t) for t in seq], dead))
            seeded.add(seq)
            stuck = _seeds.stuck_at(seq, dead)
            if stuck is not None:
                failed.add(stuck)
                continue
            if out[-1].peak > self.limit:
                kept = _seeds.unrematerialized(seq)
                for other in variants:
                    if not self.room():
                        break
                    if other not in seeded and _seeds.unrematerialized(other) == kept:
                        out.append(self.seed_path([Action.macro(t) for t in other], dead))
                        seeded.add(other)
            break
        return out

    def grow_beam(self, beam: list[_Scored]) -> None:
        """Extend the seeded sequences `beam` by one macro at a time, up to MACRO_DEPTH."""
        for _ in range(MACRO_DEPTH - 2):
            # The best by reward, and the fastest whatever their memory: a fast sequence
            # that does not fit yet is one remat or FSDP away from the best plan, while
            # ranking by reward alone keeps only what saves memory most.
            seen = {b.actions: b for b in beam}.values()
            beam = {b.actions: b for b in [*sorted(seen, key=lambda b: -b.reward)[:BEAM],
                                           *sorted(seen, key=lambda b: b.time)[:BEAM]]}.values()
            grown = []
            for b in beam:
                for a in self.macros:
                    if a not in b.actions and self.room():
                        grown.append(self.seed_path([*b.actions, a]))
            beam = grown or beam

    # -- the whole search ------------------------------------------------------------
    def room(self) -> bool:
        """Whether the time budget and the episode limit leave room for another episode."""
        over = self.max_episodes is not None and self.stats.episodes >= self.max_episodes
        return not over and time.perf_counter() - self.start < self.budget_s

    def stop_reason(self) -> str | None:
        """Why the search stops now (time budget, episode limit, convergence), or None."""
        if time.perf_counter() - self.start > self.budget_s:
            return "time budget"
        if self.max_episodes is not None and self.stats.episodes >= self.max_episodes:
            return "episode limit"
        if self.since_best >= self.patience:
            return f"converged (no better plan in {self.patience} episodes)"
        return None

    def run(self) -> SearchResult:
        """Seed the macros, run episodes until a stopping rule holds, and return the best
        plan with the runners-up; the state is back where it started."""
        self.seed_macros()
        while (why := self.stop_reason()) is None:
            self.episode()
        self.stats.stopped = why
        self.release(0)
        refined = _refine.refine_remat(self)
        if refined is not None:
            self.improve(refined)
        self.stats.states = len(self.tree)
        self.stats.elapsed = time.perf_counter() - self.start
        if self.progress is not None:
            self.progress(self.stats.episodes, self.best.time, self.stats.elapsed)
        best = self.best
        return SearchResult(best.actions, best.time, best.peak, best.peak <= self.limit, self.root_time, self.stats,
                            tuple((s.actions, s.time, s.peak) for s in self.runners_up()))

    def runners_up(self) -> list[_Scored]:
        """The best plans built from other tactics than the best one's (another set of
        macro actions), else any other plans, best first."""
        def macro_set(actions):
            return frozenset(a for a in actions if a.kind == "macro")

        best = self.best
        others = [s for s in self.top.values() if s.actions != best.actions and s.time > best.time * (1 + 1e-9)]
        distinct = [s for s in others if macro_set(s.actions) != macro_set(best.actions)]
        return sorted(distinct or others, key=lambda s: -s.reward)[:TOP_PLANS]


def mcts(state, *, budget_s: float, seed: int = 0, max_episodes: int | None = None, patience: int | None = None,
         macros=(), progress=None, start: float | None = None, seeds=()) -> SearchResult:
    """Search for the best sequence of actions from `state`'s current point (a
    `SearchState`, or a `TwinState`); `state` is left as it was. Times (the budget, the
    trace) count from `start` (a `time.perf_counter()` reading; now by default), so a
    caller can include its own set-up. `seeds` are macro sequences scored before the
    tree search begins (see `TreeSearch.seed_macros`)."""
    start = time.perf_counter() if start is None else start
    return TreeSearch(state, budget_s=budget_s, seed=seed, macros=macros, start=start, max_episodes=max_episodes,
                      patience=patience, progress=progress, seeds=seeds).run()
