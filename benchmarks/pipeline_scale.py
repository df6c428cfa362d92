"""Pipelined plans at the scale people train, as the cost model prices them (issue 24).

Per row (a model, a mesh): the published pipelined configuration (data parallel, tensor
parallel on `model`, GPipe stages on `stage`) at a few microbatch counts, and the
schedules without a pipeline that the same mesh allows (FSDP over the data and stage
axes, or data parallel with FSDP on `stage`, each with tensor parallelism), each with
its modeled step time, peak memory per device, whether it fits 80 GB, and the modeled
bubble. No search: these rows price the hand configurations (the search's pipeline
action is opt-in, `AutomaticPartition(pipelines=(M, ...))`; docs/pipeline.md).

Run: `python benchmarks/pipeline_scale.py [--rows 70b-64 ...]`. Abstract
shapes only.
"""

from __future__ import annotations

import os
import sys

# This folder holds a `search.py` of its own: the package of that name comes from the
# repository root.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402

#: The memory each device has (bytes): an H100's 80 GB.
MEMORY_LIMIT = 80e9
#: The cost model's device.
DEVICE = "h100"
#: Microbatch counts tried for the pipelined configuration.
MICROBATCHES = (8, 16, 32, 128)


@dataclasses.dataclass(frozen=True)
class Row:
    """A model (a `LlamaConfig` constant and overrides), a mesh (axis sizes) and the mesh
    axes said to cross nodes."""

    label: str
    config: str
    overrides: tuple
    mesh: tuple
    inter: tuple = ()


#: A 405B-shaped Llama: 126 layers, d 16384, 128 heads, 8 KV heads, d_ff 53248 (issue 24).
_405B = (("n_layers", 126), ("d_model", 16384), ("n_heads", 128), ("n_kv_heads", 8), ("d_ff", 53248),
         ("batch", 2048))
ROWS = {
    "70b-64": Row("Llama-3 70B, TP4 PP4 on 64 devices", "LLAMA3_70B", (), (("data", 4), ("stage", 4), ("model", 4))),
    "70b-1024": Row("Llama-3 70B on 1024 devices, data across nodes", "LLAMA3_70B", (("batch", 1024),),
                    (("data", 64), ("stage", 4), ("model", 4)), ("data",)),
    "405b-16384": Row("405B-shaped Llama, TP8 PP16 on 16384 devices", "LLAMA3_70B", _405B,
                      (("data", 128), ("stage", 16), ("model", 8)), ("data",)),
}


def _schedules(batch_per_replica: int) -> dict:
    import tactics as T

    out = {f"dp+tp+pp M={m}": [T.DataParallel("data"), T.Megatron("model"), T.Pipeline("stage", m)]
           for m in MICROBATCHES if batch_per_replica % m == 0}
    out["fsdp(data,stage)+tp"] = [T.FSDP("data"), T.FSDP("stage"), T.Megatron("model")]
    out["dp+fsdp(stage)+tp"] = [T.DataParallel("data"), T.FSDP("stage"), T.Megatron("model")]
    return out


def run(row: Row) -> None:
    """Print the row's plans."""
    import partir
    import search
    import tactics as T
    from examples import llama

    config = dataclasses.replace(getattr(llama, row.config), **dict(row.overrides))
    step, args = llama.make_train_step(config, abstract=True)
    prog = partir.lift(step, *args)
    mesh = partir.MeshSpec(row.mesh)
    print(f"{row.label} ({mesh}, {config.n_layers} layers, batch {config.batch})")
    links = {a: "inter" for a in row.inter}
    for name, schedule in _schedules(config.batch // mesh.size("data")).items():
        start = time.perf_counter()
        try:
            part = T.apply_schedule(prog, mesh, schedule).partitioning
            cost = search.CostModel(part, DEVICE, memory_limit=MEMORY_LIMIT, links=links).cost()
        except partir.PartitioningError as e:
            print(f"  {name:24s} does not apply: {e}")
            continue
        bubble = f"{search.pipeline_cost(part, part.pipelines[0], DEVICE).bubble:4.0%}" if part.pipelines else "   -"
        print(f"  {name:24s} step {cost.step_time:8.2f} s  peak {cost.memory_peak / 1e9:7.1f} GB  "
              f"{'fits' if cost.fits else 'does not fit'}  bubble {bubble}  ({time.perf_counter() - start:.1f} s)")


def main() -> None:
    """Run the rows asked for (all by default)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", choices=sorted(ROWS), default=sorted(ROWS))
    for key in parser.parse_args().rows:
        run(ROWS[key])


if __name__ == "__main__":
    main()
