"""Pictures of a plan: the search's progress, how each parameter is split, and the
schedule of each pipeline as a timeline per stage."""

from __future__ import annotations

import search

#: Box colours of the pipeline timeline: a stage's forward and backward runs.
PASS_COLOURS = {False: "tab:blue", True: "tab:orange"}
#: The timeline to draw for each pipeline schedule a plan file may name.
TIMELINES = {"gpipe": search.gpipe_timeline, "1f1b": search.onef_timeline}
#: A box of the timeline is labelled with its microbatch when it is at least this share
#: of the time axis (narrower ones would print over each other).
LABEL_WIDTH = 1 / 60
#: Height (inches) of the figure's top row and of each pipeline's timeline row.
TOP_HEIGHT, PIPELINE_HEIGHT = 4.0, 2.5


def plot(data: dict, path, timings: dict | None = None) -> None:
    """Draw plan file content `data` (see `Plan.to_json`) to `path` (see `figure`)."""
    _save(figure(data, timings), path)


def figure(data: dict, timings: dict | None = None):
    """The picture of plan file content `data` (a matplotlib Figure): the best modeled
    step time over the search's wall time (from `timings`, see `Plan.timings`; version 1
    plan files held them in their `search` section); a grid of the parameters (rows, in
    layer order) against the mesh axes (columns) whose cells say which dim of the
    parameter the axis splits; and, per pipeline, its schedule as a timeline per stage
    (one box per microbatch and pass, from the modeled tick times the file's cost holds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = [i for i in data["inputs"] if i["name"].startswith("params") and i["shape"]][:80]
    pipelines = data.get("pipelines", [])
    top = max(TOP_HEIGHT, 0.18 * len(params) + 1.5)
    fig = plt.figure(figsize=(14, top + PIPELINE_HEIGHT * len(pipelines)))
    grid = fig.add_gridspec(1 + len(pipelines), 2, width_ratios=[1, 1.3],
                            height_ratios=[top] + [PIPELINE_HEIGHT] * len(pipelines))
    _progress(fig.add_subplot(grid[0, 0]), data, timings or data.get("search", {}))
    _parameters(fig.add_subplot(grid[0, 1]), data, params)
    for i in range(len(pipelines)):
        _timeline(fig.add_subplot(grid[1 + i, :]), data, i)
    return fig


def _progress(ax, data: dict, timings: dict) -> None:
    """The search's best modeled step time over its wall time."""
    trace = timings.get("trace")
    if not trace:
        why = "no search ran\n(the plan came from a schedule of tactics)" if "search" not in data else \
            "no timings recorded\n(save with timings=True, or automap search --timings)"
        _note(ax, why)
        return
    xs = [t for t, _, _ in trace] + [timings["elapsed_s"]]
    ys = [1e3 * s for _, _, s in trace]
    ax.step(xs, ys + [ys[-1]], where="post")
    ax.set_xlabel("search time (s)")
    ax.set_ylabel("best modeled step time (ms)")
    ax.set_title("search progress")


def _parameters(ax, data: dict, params: list) -> None:
    """Which dim of each parameter each mesh axis splits."""
    if not params:
        _note(ax, "no parameters (no input named params...)")
        return
    axes = list(data["mesh"])
    grid = [[-1] * len(axes) for _ in params]
    for i, item in enumerate(params):
        for d, entry in enumerate(item["spec"]):
            for a in [] if entry is None else [entry] if isinstance(entry, str) else entry:
                grid[i][axes.index(a)] = d
    ax.imshow(grid, aspect="auto", cmap="viridis", vmin=-1, vmax=3)
    for i, row in enumerate(grid):
        for j, d in enumerate(row):
            ax.text(j, i, "whole" if d < 0 else f"dim {d}", ha="center", va="center", fontsize=6,
                    color="white" if d < 0 else "black")
    ax.set_xticks(range(len(axes)), labels=axes)
    ax.set_yticks(range(len(params)), labels=[i["name"] for i in params], fontsize=6)
    ax.set_title("which dim of each parameter each mesh axis splits")


def _timeline(ax, data: dict, index: int) -> None:
    """Pipeline `index` of the plan file: one row per stage, a box per microbatch's run
    of the stage's layers in each pass, at the modeled times; idle time is the bubble."""
    from matplotlib.patches import Patch

    entry = data["pipelines"][index]
    ticks = ((data.get("cost") or {}).get("pipelines") or [])
    draw = TIMELINES.get(entry["schedule"])
    if draw is None or index >= len(ticks):
        _note(ax, f"pipeline over {entry['axis']!r}: " + (
            f"no timeline is drawn for schedule {entry['schedule']!r}" if draw is None else
            "the plan file holds no modeled tick times (saved by an older automap): save the plan again"))
        return
    stages, m, repeats = int(data["mesh"][entry["axis"]]), int(entry["microbatches"]), int(entry.get("repeats", 1))
    tick = search.TickTimes(ticks[index]["forward_tick_s"], ticks[index]["backward_tick_s"])
    slots = draw(stages, m, tick, repeats)
    end = max(s.end for s in slots)
    idle = 1 - sum(s.end - s.start for s in slots) / (stages * end) if end > 0 else 0.0
    for s in slots:
        ax.barh(s.stage, 1e3 * (s.end - s.start), left=1e3 * s.start, height=0.8, color=PASS_COLOURS[s.backward],
                edgecolor="black", linewidth=0.5)
        if s.end - s.start >= LABEL_WIDTH * end:
            ax.text(1e3 * (s.start + s.end) / 2, s.stage, str(s.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(stages), labels=[f"stage {s}" for s in range(stages)])
    ax.set_ylim(stages - 0.5, -0.5)  # stage 0 on top
    ax.set_xlabel("modeled time from the start of the forward tick loop (ms)")
    rounds = f" going round {repeats} times" if repeats > 1 else ""
    ax.set_title(f"{entry['schedule']} pipeline over {entry['axis']!r}: {stages} stages, {m} microbatches{rounds} "
                 f"(box: microbatch), idle {idle:.0%} of each stage's time (the bubble)")
    ax.legend(handles=[Patch(color=PASS_COLOURS[b], label=label) for b, label in ((False, "forward"),
                                                                                  (True, "backward"))],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center")
    ax.set_axis_off()


def _save(fig, path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
