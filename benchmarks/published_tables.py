"""The tables `make bench-published` prints (`published.py`): the published rows by split,
and the configurations of one model ranked."""

from __future__ import annotations

from benchmarks.published_rows import NOISE, SPLITS, TIE, Row


#: Characters a row of the runs' tables may take: the widest cells (a remat policy's
#: name, why a row is not expressible) print whole.
ROWS_WIDTH = 224


def print_rows(rows: list[Row], results: dict) -> None:
    """One table a split (`SPLITS`): each row's published figure and, where modeled
    (`results`, by id, as `published.model_rows` gives them), its modeled MFU, error,
    the measured step less the modeled one in seconds (a cost the model lacks shows as
    the same seconds on rows of different step times: the MFU error divides it by the
    step), peak and searched plan's figures; else why the row is not expressible."""
    from rich.console import Console
    from rich.table import Table

    for split in SPLITS:
        table = Table(title=f"published runs, {split} rows (MFU by each source's formula)")
        for col in ("run", "device", "mesh", "remat", "published MFU", "modeled MFU", "error",
                    "measured -\nmodeled step", "peak", "searched MFU", "searched/published step"):
            # A run's id is what the tests and the rankings name: it never wraps.
            table.add_column(col, justify="left" if col in ("run", "mesh") else "right", no_wrap=col == "run")
        for r in rows:
            if r.split != split:
                continue
            res = results.get(r.id)
            if res is None:
                table.add_row(r.id, f"{r.devices}x {r.device}", _parallel(r), r.remat, _published(r), "-",
                              f"not expressible: {r.why_not}", "", "", "", "")
                continue
            p, s = res["published"], res.get("searched")
            table.add_row(r.id, f"{r.devices}x {r.device}", _parallel(r), r.remat, f"{res['published_mfu']:.1%}",
                          f"{p['mfu']:.1%}", f"{res['error']:+.1%}",
                          f"{res['published_step_s'] - p['step_s']:+.2f} s", f"{p['peak_gib']:.0f} GiB"
                          + ("" if p["fits"] else " (no fit)"),
                          f"{s['mfu']:.1%}" + ("" if s["fits"] else " (no fit)") if s else "-",
                          _searched_step(res) if s else "-")
        Console(width=ROWS_WIDTH).print(table)


def _searched_step(res: dict) -> str:
    """The searched step over the published one, with the searched plan's form where it
    is not the micro-batch step the row runs (`Searched.form`)."""
    form = res["searched_form"]
    return f"{res['searched_over_published']:.2f}" + ("" if form == "micro-batches" else f" ({form})")


def print_rankings(pairs: list[dict]) -> None:
    """The configurations of one model ranked (`published.rankings`' pairs)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"configurations of one model, ranked (time per token per device of the second over the first; a measured gap "
                        f"under {NOISE:.0%} is a tie, which the model must keep under {TIE:.0%})")
    for col in ("first", "second", "measured", "modeled", "ranked as measured"):
        table.add_column(col, justify="left" if col in ("first", "second") else "right")
    for p in pairs:
        table.add_row(p["first"], p["second"], f"{p['measured']:+.1%}" + (" (tie)" if p["tie"] else ""),
                      f"{p['modeled']:+.1%}", "yes" if p["ok"] else "NO")
    Console(width=200).print(table)


def _parallel(r: Row) -> str:
    return " ".join(f"{k}{v}" for k, v in r.parallelism.items() if v > 1) or "-"


def _published(r: Row) -> str:
    kind, value = r.measured["kind"], r.measured["value"]
    return {"mfu": f"{value:.1%}", "tflops_device": f"{value:g} TFLOP/s", "step_s": f"{value:g} s",
            "tokens_per_s_device": f"{value:g} tok/s"}[kind]
