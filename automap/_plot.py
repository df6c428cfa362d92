"""Pictures of a plan: the search's progress and how each parameter is split."""

from __future__ import annotations


def plot(data: dict, path, timings: dict | None = None) -> None:
    """Draw plan file content `data` (see `Plan.to_json`) to `path`: the best modeled
    step time over the search's wall time (from `timings`, see `Plan.timings`; version 1
    plan files held them in their `search` section), and a grid of the
    parameters (rows, in layer order) against the mesh axes (columns) whose cells say
    which dim of the parameter the axis splits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = list(data["mesh"])
    params = [i for i in data["inputs"] if i["name"].startswith("params") and i["shape"]][:80]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, max(4.0, 0.18 * len(params) + 1.5)),
                                      gridspec_kw={"width_ratios": [1, 1.3]})
    timings = timings or data.get("search", {})
    trace = timings.get("trace")
    if trace:
        xs = [t for t, _, _ in trace] + [timings["elapsed_s"]]
        ys = [1e3 * s for _, _, s in trace]
        left.step(xs, ys + [ys[-1]], where="post")
        left.set_xlabel("search time (s)")
        left.set_ylabel("best modeled step time (ms)")
        left.set_title("search progress")
    else:
        why = "no search ran\n(the plan came from a schedule of tactics)" if "search" not in data else \
            "no timings recorded\n(save with timings=True, or automap search --timings)"
        left.text(0.5, 0.5, why, ha="center", va="center")
        left.set_axis_off()
    if not params:
        right.text(0.5, 0.5, "no parameters (no input named params...)", ha="center", va="center")
        right.set_axis_off()
        _save(fig, path)
        return
    grid = [[-1] * len(axes) for _ in params]
    for i, item in enumerate(params):
        for d, entry in enumerate(item["spec"]):
            for a in [] if entry is None else [entry] if isinstance(entry, str) else entry:
                grid[i][axes.index(a)] = d
    right.imshow(grid, aspect="auto", cmap="viridis", vmin=-1, vmax=3)
    for i, row in enumerate(grid):
        for j, d in enumerate(row):
            right.text(j, i, "whole" if d < 0 else f"dim {d}", ha="center", va="center", fontsize=6,
                       color="white" if d < 0 else "black")
    right.set_xticks(range(len(axes)), labels=axes)
    right.set_yticks(range(len(params)), labels=[i["name"] for i in params], fontsize=6)
    right.set_title("which dim of each parameter each mesh axis splits")
    _save(fig, path)


def _save(fig, path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
