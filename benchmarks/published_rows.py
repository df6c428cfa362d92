"""The published runs' data (`benchmarks/published/runs.toml`): the row schema and its
checks (`load`), and each source's model-flops formula (`FORMULAS`), which turns a
published figure into a step time (`published_step`). `benchmarks/published.py` models
the rows; see its docstring for what the benchmark prints and how.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib

#: The data file.
RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published", "runs.toml")
#: Search episodes per row (a row may ask for more: its `episodes`, and says why): small,
#: so that the whole benchmark stays within minutes, and deterministic.
EPISODES = 300
#: Relative error band the modeled MFU of a published configuration must hold.
BAND = 0.15
#: A measured gap in time per token under this (relative) is within one run's noise:
#: the pair is a tie (the data file's header says why).
NOISE = 0.01
#: The most a tie's modeled gap may be (the data file's header says why).
TIE = 0.05
SPLITS = ("fit", "check")
REMAT = ("none", "dots", "dots_with_context", "dots_except_mlp_in", "dots_except_mlp", "every_other_dot", "qkv", "full",
         "full/2")
#: How the run's train step picks the targets' log-probabilities (`examples.llama.LOSSES`).
LOSSES = ("gather", "one_hot")
#: The layers' matmul precisions a row may run: bfloat16, or FP8 (E4M3 forward, E5M2
#: gradients: `examples/_fp8.py`), every other op in bfloat16.
DTYPES = ("bfloat16", "float8")
#: How a float8 row scales its FP8 tensors (the data file's header; `examples/_fp8.py`'s
#: SCALINGS).
FP8_SCALINGS = ("delayed", "current")
KINDS = ("step_s", "tokens_per_s_device", "tflops_device", "mfu")
PARALLELISM = ("dp", "fsdp", "tp", "pp", "cp", "ep", "vp")
#: The row's switches (the data file's header says what each means).
_FLAGS = ("expressible", "master_weights", "tp_comm_overlap", "sequence_parallel", "fused_kernels")


@dataclasses.dataclass(frozen=True)
class Row:
    """One published run (fields as in the data file's header)."""

    id: str
    model: str
    split: str
    source: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    seq: int
    devices: int
    device: str
    parallelism: dict
    remat: str
    dtype: str
    measured: dict
    flops: str
    expressible: bool
    global_batch: int = 0
    micro_batch: int = 0
    grad_accum: int = 1
    experts: int = 0
    top_k: int = 0
    mesh: tuple = ()
    reported: dict = dataclasses.field(default_factory=dict)
    remat_note: str = ""
    why_not: str = ""
    master_weights: bool = False
    tp_comm_overlap: bool = False
    sequence_parallel: bool = False
    loss: str = "gather"
    fused_kernels: bool = False
    fp8_scaling: str = "delayed"
    pipeline: dict = dataclasses.field(default_factory=dict)
    pipeline_note: str = ""
    episodes: int = EPISODES
    episodes_note: str = ""

    @property
    def mesh_axes(self) -> tuple:
        """((axis, size), ...) of the published configuration's mesh."""
        return tuple((str(a), int(n)) for a, n in self.mesh)


def _check(row: dict, where: str) -> Row:
    """A `Row` from a TOML table, or a `ValueError` naming the row, the field and the fix."""
    names = {f.name for f in dataclasses.fields(Row)}
    unknown = sorted(set(row) - names)
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; allowed: {sorted(names)}")
    try:
        r = Row(**row)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from e
    problems = []
    if r.split not in SPLITS:
        problems.append(f"split {r.split!r} not in {SPLITS}")
    if r.remat not in REMAT:
        problems.append(f"remat {r.remat!r} not in {REMAT}")
    if r.loss not in LOSSES:
        problems.append(f"loss {r.loss!r} not in {LOSSES}")
    if r.dtype not in DTYPES:
        problems.append(f"dtype {r.dtype!r} not in {DTYPES}")
    if r.fp8_scaling not in FP8_SCALINGS:
        problems.append(f"fp8_scaling {r.fp8_scaling!r} not in {FP8_SCALINGS}")
    elif r.fp8_scaling != "delayed" and r.dtype != "float8":
        problems.append(f"fp8_scaling {r.fp8_scaling!r} is for a float8 row (dtype {r.dtype!r}); leave it out")
    flags = [f for f in _FLAGS if not isinstance(getattr(r, f), bool)]
    if flags:
        problems.append(f"{', '.join(flags)} must be true or false")
    if r.measured.get("kind") not in KINDS or not r.measured.get("value", 0) > 0:
        problems.append(f"measured must be {{kind in {KINDS}, value > 0}}, got {r.measured}")
    if r.flops not in FORMULAS and r.flops != "reported":
        problems.append(f"flops {r.flops!r} not in {sorted(FORMULAS) + ['reported']}")
    if not (isinstance(r.grad_accum, int) and r.grad_accum >= 1 and r.global_batch % r.grad_accum == 0):
        problems.append(f"grad_accum must be a whole number >= 1 dividing global_batch, got {r.grad_accum!r}")
    if set(r.parallelism) - set(PARALLELISM):
        problems.append(f"parallelism keys {sorted(r.parallelism)} not within {PARALLELISM}")
    problems += _pipeline_problems(r)
    if not (isinstance(r.episodes, int) and r.episodes >= 1):
        problems.append(f"episodes must be a whole number >= 1, got {r.episodes!r}")
    if r.expressible:
        size = 1
        for _, n in r.mesh_axes:
            size *= n
        if size != r.devices or r.global_batch <= 0 or r.flops == "reported":
            problems.append("an expressible row needs a mesh of `devices` devices, a global_batch and a formula")
    elif not r.why_not:
        problems.append("a row that is not expressible says why (why_not)")
    if problems:
        raise ValueError(f"{where} ({r.id}): " + "; ".join(problems))
    return r


#: The keys of a row's `pipeline` table (`tactics.Pipeline`'s arguments but its axis,
#: which is the mesh's `STAGE_AXIS`).
PIPELINE_KEYS = ("microbatches", "schedule", "repeats")
#: The mesh axis a published configuration's pipeline stages run over.
STAGE_AXIS = "stage"


def _pipeline_problems(r: Row) -> list[str]:
    """What is wrong with the row's `pipeline` table against its mesh: a mesh with a
    `STAGE_AXIS` and a pipeline go together; microbatches and repeats whole numbers >= 1,
    the schedule one `partir` runs."""
    import partir

    staged = STAGE_AXIS in dict(r.mesh_axes)
    if not r.pipeline:
        return [f"a mesh with a {STAGE_AXIS!r} axis needs a `pipeline` table ({', '.join(PIPELINE_KEYS)})"] \
            if staged else []
    out = [] if staged else [f"a `pipeline` needs a {STAGE_AXIS!r} axis in the mesh"]
    unknown = sorted(set(r.pipeline) - set(PIPELINE_KEYS))
    if unknown:
        out.append(f"pipeline keys {unknown} not within {PIPELINE_KEYS}")
    for key in ("microbatches", "repeats"):
        n = r.pipeline.get(key, 1)
        if not (isinstance(n, int) and n >= 1):
            out.append(f"pipeline {key} must be a whole number >= 1, got {n!r}")
    if r.pipeline.get("schedule", "gpipe") not in partir.PIPELINE_SCHEDULES:
        out.append(f"pipeline schedule {r.pipeline['schedule']!r} not in {partir.PIPELINE_SCHEDULES}")
    return out


def load(path: str = RUNS) -> list[Row]:
    """The rows of the data file, schema-checked."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    rows = [_check(t, f"{path}: run {i}") for i, t in enumerate(data.get("run", []))]
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate run ids in {ids}")
    return rows


# -- the sources' model-flops formulas (per device, per step) ---------------------------

def _params(r: Row) -> int:
    hd = r.d_model // r.heads
    attn = r.d_model * hd * (2 * r.heads + 2 * r.kv_heads)
    return 2 * r.vocab * r.d_model + r.layers * (attn + 3 * r.d_model * r.d_ff + 2 * r.d_model) + r.d_model


def _tokens(r: Row) -> float:
    return r.global_batch * r.seq / r.devices


def _maxtext_2023(r: Row) -> float:
    # maxtext_utils.calculate_tflops_training_per_device (2023, PaLM appendix B): 6 N per
    # token plus causal attention, 12 H L hd S^2 / 2 per sequence.
    hd = r.d_model // r.heads
    return _tokens(r) * (6 * _params(r) + 6 * r.heads * r.layers * hd * r.seq)


def _maxtext_2024(r: Row) -> float:
    # maxtext_utils.calculate_tflops_training_per_device (2024): 3 x (per layer: SwiGLU
    # MLP, QKV and output projections, attention 4 S H hd uncausal; plus the LM head).
    d, f, h, k, hd = r.d_model, r.d_ff, r.heads, r.kv_heads, r.d_model // r.heads
    layer = 2 * d * f * 3 + 2 * d * (h + 2 * k) * hd + 2 * h * hd * d + 4 * r.seq * h * hd
    return 3 * _tokens(r) * (r.layers * layer + 2 * d * r.vocab)


def _torchtitan(r: Row) -> float:
    # torchtitan's get_num_flop_per_token: 6 N + 12 L H hd S per token.
    hd = r.d_model // r.heads
    return _tokens(r) * (6 * _params(r) + 12 * r.layers * r.heads * hd * r.seq)


def _nemo(r: Row) -> float:
    # NVIDIA's DGX Cloud Benchmarking recipes for NeMo (llama3.1/README_8b.md, Notes, at
    # v24.11.1): per token, 12 L d^2 (1 + KV heads / heads + S / d) for the projections
    # and uncausal attention, 18 L d_ff d for the SwiGLU MLP, 6 V d for the LM head.
    d, s = r.d_model, r.seq
    attention = 12 * r.layers * d * d * (1 + r.kv_heads / r.heads + s / d)
    return _tokens(r) * (attention + 18 * r.layers * r.d_ff * d + 6 * r.vocab * d)


FORMULAS = {"maxtext-2023": _maxtext_2023, "maxtext-2024": _maxtext_2024, "torchtitan": _torchtitan,
            "nemo": _nemo}


def published_step(r: Row) -> float:
    """The published step time (seconds) of an expressible row."""
    kind, value = r.measured["kind"], r.measured["value"]
    if kind == "step_s":
        return value
    if kind == "tokens_per_s_device":
        return _tokens(r) / value
    if kind == "tflops_device":
        return FORMULAS[r.flops](r) / (value * 1e12)
    raise ValueError(f"{r.id}: a {kind} figure gives no step time")
