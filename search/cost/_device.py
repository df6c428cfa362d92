"""Accelerator descriptions for the cost model, and which link each mesh axis uses.

A `DeviceSpec` holds per-device peak flop/s per dtype, HBM capacity and bandwidth, and
the bandwidth and per-hop latency of two link levels: intra-node (NVLink, TPU ICI) and
inter-node (InfiniBand, TPU DCN). `get_device` resolves a spec, a `PRESETS` name, or a
.json/.toml file holding `DeviceSpec.to_dict()`; `link_levels` maps mesh axes to levels.

Choices shared by the presets:
- Peaks are dense: NVIDIA datasheets print 2:4-sparse figures, so dense is half of them.
- 'float32' is the rate of a float32 *dot* under JAX's default matmul precision, as dots
  carry the flops: TF32 tensor cores on Ampere/Hopper, one bf16 pass on TPU (JAX docs,
  "Matmul precision": "bfloat16 on TPU, TF32 on recent GPUs"). Elementwise float32 runs
  slower (CUDA cores, VPU), but it is HBM-bound, so the roofline's HBM term prices it.
- Bandwidths are per device per direction, as `_comm`'s ring model uses them.
- Latencies are estimates (orders of magnitude), not published figures.

**Time model.** What a device really achieves is below its datasheet: the optional
fields after the flags say how far (`search.cost._model`'s docstring has the formulas, and
`benchmarks/published/` the runs they were checked against). Their defaults are the
ideal machine, which is what the `cpu` preset and a user's file without them get:
- `matmul_efficiency`: the fraction of peak a large matmul reaches; `matmul_knee`: the
  per-device dim (elements) at which a matmul's efficiency halves along it (small and
  skinny matmuls fill the tensor cores or MXUs badly), 0 for none;
- `attention_efficiency`: the fraction of peak the fused attention kernel reaches
  (`fused_attention` on: cuDNN/flash attention on GPU, splash attention on TPU);
- `collective_efficiency`: the fraction of link bandwidth a collective's bus bandwidth
  reaches at large messages (NCCL-tests' busbw, ICI all-gathers);
- `overlap` (a flag): the backend's latency-hiding scheduler runs weight gathers and
  gradient reductions behind compute; `overlap_slowdown`: the fraction of the hidden
  communication time added to compute (the SMs or DMA engines collectives take);
  `overlap_activations` (a flag): activation collectives (tensor parallelism's) run
  behind independent compute too (XLA:TPU's async collective fusion);
- `op_overhead`: seconds each matmul or attention kernel costs beyond its roofline
  (launch and tail: what dominates at small per-device work);
- `torus_dims`, `torus_side`: a TPU slice's ICI torus (dims, chips along a side), 0 for
  a switched network: a collective over more chips than a side runs rings along several
  dims at once.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from tactics import check

__all__ = ["DEFAULT_DEVICE", "DeviceError", "DeviceSpec", "PRESETS", "get_device", "link_levels"]


class DeviceError(ValueError):
    """A device name, file, description or link override that cannot be used."""


_FLOAT_FIELDS = ("hbm_bytes", "hbm_bandwidth", "intra_bandwidth", "intra_latency", "inter_bandwidth", "inter_latency")
#: Backend behaviours (true or false), optional in a device description.
_FLAGS = ("reduce_scatter", "breadth_first", "gather_copies", "fused_attention", "overlap", "overlap_activations",
          "priority_fusion", "reassociate")
#: Time-model fractions in (0, 1], optional (default 1: the datasheet figure).
_FRACTIONS = ("matmul_efficiency", "attention_efficiency", "collective_efficiency")
#: Time-model figures >= 0, optional (default 0: none).
_NONNEGATIVE = ("matmul_knee", "overlap_slowdown", "op_overhead")
#: Topology integers >= 0, optional (default 0: a switched network).
_TOPOLOGY = ("torus_dims", "torus_side")
_OPTIONAL = _FLAGS + _FRACTIONS + _NONNEGATIVE + _TOPOLOGY


def _number(where: str, v) -> float:
    # bool is an int subclass; `true` in a TOML file is a typo, not a figure. A figure of
    # 400 digits (JSON and TOML read it as an int) is too large for a float.
    return check.number(where, v, example=f"{where}=1e12", error=DeviceError)


def _dtype_name(dtype) -> str:
    # Arrays (and avals) carry a dtype; JAX deprecates np.dtype(array), so read it off.
    if not isinstance(dtype, (str, type, np.dtype)) and hasattr(dtype, "dtype"):
        dtype = dtype.dtype
    # np.dtype takes numpy/JAX scalar types, dtypes and names like 'f4'; plain numpy does
    # not know 'bfloat16' or the float8 names as strings, so those are kept as given.
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).strip().lower()


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Figures of one accelerator and its links, per device.

    `peak_flops` pairs a dtype name with dense flop/s; it must have 'float32'. Bandwidths
    are bytes/s per device per direction; latencies are seconds per ring hop.
    `devices_per_node` devices (consecutive ids) share the fast intra-node link.
    `reduce_scatter` is False for a backend that lowers reduce-scatter to an all-reduce
    and a slice (XLA:CPU). `breadth_first` is True for a backend that schedules breadth
    first, each op as soon as its operands are ready (XLA:CPU's default scheduler, which
    also runs after optimization barriers are gone): a value moved for its readers is
    moved as soon as it is made, even for the backward pass. `gather_copies` is True
    for a backend that all-gathers with the gathered dim major and copies the result
    row-major for each way dots read it (XLA:CPU). `fused_attention` is True for a
    backend whose `jax.nn.dot_product_attention` runs as one fused kernel that never
    materializes the `[B, H, S, S]` scores (cuDNN on GPU, splash on TPU).
    `priority_fusion` is True for a backend that fuses a cheap elementwise producer into
    all its readers, reductions included, whenever that moves fewer bytes (XLA:GPU's
    priority fusion; `search._fusion`): XLA:CPU makes a buffer of one a reduction reads.
    `reassociate` is True for a backend that reduces a sum of reduced values once,
    `add(all-reduce(a), all-reduce(b)) -> all-reduce(add(a, b))` (XLA:GPU's
    `AllReduceReassociate` and `ReduceScatterReassociate`; `search.cost._reassociate`).
    The time-model fields (module docstring) default to the ideal machine.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    hbm_bytes: float
    hbm_bandwidth: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    devices_per_node: int
    reduce_scatter: bool = True
    breadth_first: bool = False
    gather_copies: bool = False
    fused_attention: bool = False
    overlap: bool = False
    overlap_activations: bool = False
    priority_fusion: bool = False
    reassociate: bool = False
    matmul_efficiency: float = 1.0
    attention_efficiency: float = 1.0
    collective_efficiency: float = 1.0
    matmul_knee: float = 0.0
    overlap_slowdown: float = 0.0
    op_overhead: float = 0.0
    torus_dims: int = 0
    torus_side: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise DeviceError(f"name must be a non-empty string, got {self.name!r}")
        pf = self.peak_flops.items() if isinstance(self.peak_flops, Mapping) else self.peak_flops
        try:
            pairs = tuple((str(k), v) for k, v in pf)
        except (TypeError, ValueError) as e:  # not pairs: report it as a bad description
            raise DeviceError(f"peak_flops must map dtype names to flop/s: {e}") from e
        pf = tuple((k, _number(f"peak_flops[{k!r}]", v)) for k, v in pairs)
        if "float32" not in dict(pf) or len(dict(pf)) != len(pf):  # float32: flops_for's fallback
            raise DeviceError(f"peak_flops needs one entry per dtype, float32 among them: {pf}")
        object.__setattr__(self, "peak_flops", pf)
        for f in _FLOAT_FIELDS:
            object.__setattr__(self, f, _number(f, getattr(self, f)))
        check.number("devices_per_node", self.devices_per_node, integer=True, example="devices_per_node=8",
                     error=DeviceError)
        for flag in _FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise DeviceError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        self._check_time_model()

    def _check_time_model(self) -> None:
        for f in _FRACTIONS:
            v = _number(f, getattr(self, f))
            if v > 1:
                raise DeviceError(f"{f} must be a fraction of the peak in (0, 1], got {v!r}")
            object.__setattr__(self, f, v)
        for f in _NONNEGATIVE:
            object.__setattr__(self, f, check.number(f, getattr(self, f), sign="non-negative",
                                                     example=f"{f}=0", error=DeviceError))
        if self.overlap_slowdown >= 1:
            raise DeviceError(f"overlap_slowdown must be below 1, got {self.overlap_slowdown!r}")
        for f in _TOPOLOGY:
            check.number(f, getattr(self, f), integer=True, sign="non-negative", example=f"{f}=0", error=DeviceError)

    def flops_for(self, dtype) -> float:
        """Peak flop/s for `dtype` (a numpy/JAX dtype, scalar type, array or name).

        A dtype with no entry (int32, bool, float64, a float8 on a chip without float8...)
        gets the 'float32' figure: a rough stand-in, as such ops are rarely flop-bound.
        """
        table = dict(self.peak_flops)
        return table.get(_dtype_name(dtype), table["float32"])

    def to_dict(self) -> dict:
        """Plain dict (peak_flops as a {dtype: flop/s} mapping) for JSON/TOML files."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["peak_flops"] = dict(self.peak_flops)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> DeviceSpec:
        """Inverse of `to_dict`; the backend flags (`reduce_scatter`, `breadth_first`,
        `gather_copies`, `fused_attention`, `overlap`, `overlap_activations`,
        `priority_fusion`, `reassociate`: defaults True, then False) and the
        time-model fields (defaults: the ideal machine) may be left out.

        Unknown or missing keys raise `DeviceError` naming them and the allowed keys.
        """
        if not isinstance(d, Mapping):
            raise DeviceError(f"a device description must be a mapping, got {type(d).__name__}")
        allowed = [f.name for f in fields(cls)]
        unknown = [k for k in d if k not in allowed]
        missing = [k for k in allowed if k not in d and k not in _OPTIONAL]
        if unknown or missing:
            parts = ([f"unknown keys {unknown}"] if unknown else []) + ([f"missing keys {missing}"] if missing else [])
            raise DeviceError(f"bad device description: {'; '.join(parts)}; allowed keys: {', '.join(allowed)}")
        if not isinstance(d["peak_flops"], Mapping):
            raise DeviceError(f"peak_flops must be a {{dtype: flop/s}} mapping, got {d['peak_flops']!r}")
        return cls(**d)


# Interconnect figures shared by the GPU presets (per GPU, per direction).
_NVLINK4 = 450e9  # NVLink 4 (H100/H200 SXM datasheets): 900 GB/s bidirectional per GPU
_NVLINK3 = 300e9  # NVLink 3 (A100 datasheet): 600 GB/s bidirectional per GPU
_NVLINK2 = 150e9  # NVLink 2 (V100 SXM2 datasheet): 300 GB/s bidirectional per GPU
_NDR = 50e9  # InfiniBand NDR 400 Gb/s, one HCA per GPU (DGX H100: 8x ConnectX-7)
_HDR = 25e9  # InfiniBand HDR 200 Gb/s, one HCA per GPU (DGX A100: 8x ConnectX-6)
_EDR = 12.5e9  # InfiniBand EDR 100 Gb/s per GPU; optimistic: DGX-1 has 4 EDR ports for 8 GPUs
_EFA_P4 = 400e9 / 8 / 8  # AWS EFA on p4d/p4de: 400 Gb/s (4 x 100) an instance of 8 GPUs, 6.25 GB/s a GPU
_NVLINK_HOP = 1e-6  # estimate: order of a small-message NVLink/NVSwitch hop
_IB_HOP = 5e-6  # estimate: order of a small-message RDMA hop through an IB switch
_ICI_HOP = 1e-6  # estimate: order of a TPU ICI hop
_DCN_HOP = 10e-6  # estimate: DCN goes through the host NIC and datacenter fabric, slower than IB


def _flops(f32, bf16, f16, f8=None):
    pf = (("float32", f32), ("bfloat16", bf16), ("float16", f16))
    # Hopper's FP8 tensor cores run E4M3 and E5M2 at one rate.
    return pf + ((("float8_e4m3fn", f8), ("float8_e5m2", f8)) if f8 else ())


#: Bytes in a GiB. A GPU's "80GB" of HBM are 80 GiB (five 16 GiB stacks; the driver of an
#: A100 80GB reports 81,920 MiB): datasheet capacities are read as GiB.
GIB = 2**30
#: The fraction of a GPU's memory a training step's buffers may use: NVIDIA's guide to
#: LLMs with JAX and XLA on GPUs (NVIDIA/JAX-Toolbox, rosetta/docs/GPU_performance.md)
#: sets XLA_PYTHON_CLIENT_MEM_FRACTION to 0.9: the rest goes to NVIDIA's libraries and
#: JAX itself (the CUDA context, cuBLAS and cuDNN workspaces, NCCL's buffers). JAX's own
#: default, 0.75, is for a GPU shared with other processes.
GPU_MEMORY_FRACTION = 0.9


def _gpu(name, flops, hbm_gib, hbm_bw, nvlink, ib, **time):
    # Every GPU preset is an 8-GPU HGX/DGX board: NVLink inside it, InfiniBand across.
    # The memory a step may use: the datasheet's GiB, less what the runtime takes.
    return DeviceSpec(name, flops, hbm_gib * GIB * GPU_MEMORY_FRACTION, hbm_bw, nvlink, _NVLINK_HOP, ib, _IB_HOP,
                      devices_per_node=8, **time)


# The time model of the GPU and TPU presets (module docstring), from the vendors'
# published figures where they exist and else fit on the `fit` rows of
# `benchmarks/published/` (`python benchmarks/published.py --fit` re-derives them;
# `check` rows choose nothing). The names say which.
#: Fit: large bf16 GEMMs through cuBLAS/XLA reach this fraction of the dense datasheet
#: peak on Hopper and Ampere.
GPU_MATMUL_EFFICIENCY = 0.658
#: Fit: large matmuls on the MXUs (XLA:TPU) reach this fraction of peak.
TPU_MATMUL_EFFICIENCY = 0.843
#: Estimate: a per-device matmul dim of this many elements halves the rate along it
#: (one 128-wide tile of the tensor cores or MXU half filled).
MATMUL_KNEE = 32.0
#: Fit: the fused attention kernels (cuDNN on GPU, splash on TPU) reach this fraction of
#: peak on the tiles they compute.
ATTENTION_EFFICIENCY = 0.586
#: NCCL-tests' bus bandwidth reaches about 80% of the NVLink/InfiniBand line rate at
#: large messages (all-reduce and all-gather on DGX H100/A100 boards); taken for ICI too.
COLLECTIVE_EFFICIENCY = 0.80
#: Estimate: hidden collectives slow the compute they hide behind by this fraction of
#: their time (NCCL's kernels take SMs; TPU DMA shares HBM bandwidth).
OVERLAP_SLOWDOWN = 0.10
#: Estimate: seconds a GPU kernel costs beyond its roofline (launch and tail, XLA's
#: fused kernels launched back to back).
GPU_OP_OVERHEAD = 4e-6
#: Estimate: a TPU op's fixed cost (program step, DMA set-up).
TPU_OP_OVERHEAD = 2e-6
_GPU_TIME = dict(fused_attention=True, overlap=True, priority_fusion=True, reassociate=True,
                 matmul_efficiency=GPU_MATMUL_EFFICIENCY,
                 matmul_knee=MATMUL_KNEE, attention_efficiency=ATTENTION_EFFICIENCY,
                 collective_efficiency=COLLECTIVE_EFFICIENCY, overlap_slowdown=OVERLAP_SLOWDOWN,
                 op_overhead=GPU_OP_OVERHEAD)
# XLA:TPU's fusion and collective passes are not public. Its presets fuse a cheap op into
# all its readers, reductions included, as XLA:GPU does (`priority_fusion`): MaxText's 32B
# on 64 v5p (published, `benchmarks/published/`) fits the chip's 95.74 GiB so (95.0 GiB
# modeled) and cannot with XLA:CPU's rule, which makes buffers of the float32 copies its
# norms and loss reduce (97.3 GiB). They keep XLA:CPU's reductions of sums (`reassociate`
# off), of which no published run says anything.
_TPU_TIME = dict(_GPU_TIME, matmul_efficiency=TPU_MATMUL_EFFICIENCY, op_overhead=TPU_OP_OVERHEAD,
                 overlap_activations=True, priority_fusion=True, reassociate=False)


#: The HBM XLA:TPU lets one program use, per chip, as its out-of-memory errors print it
#: ("Used X of Y hbm", XLA's binary units: G is GiB): the chip's HBM less what the
#: runtime keeps. v5p: "exceeding available bytes: 95.74G" (openxla.org, XLA error
#: E1000's sample, a SparseCore TPU), 96 GiB of HBM2e that the Cloud TPU docs print as
#: "95 GB"; v4: "Used 33.27G of 30.75G" (AI-Hypercomputer/maxtext pull 4117, v4-384),
#: of 32 GiB; v5e: "of 15.75G hbm" (users' v5e errors), of 16 GiB. A step that fits
#: these fits the chip, as the published TPU runs do.
TPU_USABLE_GIB = {"tpu-v4": 30.75, "tpu-v5e": 15.75, "tpu-v5p": 95.74}


# Figures per device. GPU sources are the NVIDIA datasheets of the named SKU; dense flops
# are the printed sparse ones / 2. TPU sources are the Google Cloud TPU docs page of each
# version, where a "node" is the ICI domain (the largest pod slice) and DCN joins slices.
#: The device plans are costed for unless a setting names another: the one default, read
#: by the cost model, the search, automap's settings and the CLI.
DEFAULT_DEVICE = "h100"

PRESETS: dict[str, DeviceSpec] = {
    # H100 SXM5 80GB: TF32 989/2 (the f32 dot), BF16 = FP16 1,979/2, FP8 3,958/2 TFLOPS;
    # 80 GB HBM3 (80 GiB, `GIB`), 3.35 TB/s.
    "h100": _gpu("h100", _flops(494.5e12, 989.5e12, 989.5e12, 1979e12), 80, 3.35e12, _NVLINK4, _NDR,
                 **_GPU_TIME),
    # H200 SXM 141GB: H100 compute (same datasheet figures); 141 GB HBM3e at 4.8 TB/s.
    "h200": _gpu("h200", _flops(494.5e12, 989.5e12, 989.5e12, 1979e12), 141, 4.8e12, _NVLINK4, _NDR,
                 **_GPU_TIME),
    # A100 SXM 80GB: TF32 312/2, BF16 = FP16 624/2 TFLOPS, no FP8; 80 GB HBM2e, 2,039 GB/s.
    "a100": _gpu("a100", _flops(156e12, 312e12, 312e12), 80, 2.039e12, _NVLINK3, _HDR, **_GPU_TIME),
    # The same A100 board on AWS (p4de.24xlarge: 8 A100 SXM 80GB on NVSwitch), its nodes
    # joined by EFA at 400 Gb/s an instance where a DGX A100 has 200 Gb/s of InfiniBand
    # per GPU: an axis across nodes moves data at an eighth of the `a100` preset's rate.
    # EFA's small-message latency is taken as InfiniBand's (`_IB_HOP`, an estimate too).
    "a100-efa": _gpu("a100-efa", _flops(156e12, 312e12, 312e12), 80, 2.039e12, _NVLINK3, _EFA_P4, **_GPU_TIME),
    # V100 SXM2 32GB: FP32 15.7 TFLOPS (no TF32 on Volta), FP16 tensor cores 125 TFLOPS
    # (no sparsity on Volta). No BF16 tensor cores: a bf16 dot runs on the CUDA cores, at
    # best at the FP32 rate, so 'bfloat16' gets that. 32 GB HBM2, 900 GB/s. DGX-1 wires its 8 GPUs
    # as a hybrid cube-mesh, not a switch: the NVLink figure is the per-GPU total. No time
    # model: no published run of ours is on V100, and cuDNN's fused attention needs Ampere.
    "v100": _gpu("v100", _flops(15.7e12, 15.7e12, 125e12), 32, 900e9, _NVLINK2, _EDR),
    # TPU v4: "275 teraflops (bf16 or int8)" per chip; float32 at the same rate (one bf16
    # pass, JAX's default), float16 assumed (not documented) to be converted to that path.
    # "32 GiB, 1200 GBps" HBM2, of which a program may use `TPU_USABLE_GIB`. ICI, derived
    # estimate: "all-reduce bandwidth per Pod 1.1 PB/s" / 4096 chips ~ 270 GB/s per chip
    # over 6 links ~ 45 GB/s per link per direction; a ring along one torus dimension uses
    # its 2 links: 90 GB/s. DCN, estimate: 50 Gb/s per chip, the figure the docs give for
    # v5p (none is given for v4).
    # "TPU Pod size 4096 chips" is the ICI domain.
    # Slices are built of 4x4x4 cubes on a 3-D torus.
    "tpu-v4": DeviceSpec(
        "tpu-v4", _flops(275e12, 275e12, 275e12), TPU_USABLE_GIB["tpu-v4"] * GIB, 1200e9,
        90e9, _ICI_HOP, 6.25e9, _DCN_HOP, devices_per_node=4096, torus_dims=3, torus_side=4, **_TPU_TIME,
    ),
    # TPU v5e: "197 TFLOPs" bf16 per chip, float32/float16 as for v4, no float8 (int8
    # only); "16 GB, 819 GBps" HBM, of which `TPU_USABLE_GIB`. ICI, derived: "400 GBps
    # bidirectional per chip" over "4 ICI ports" = 50 GB/s per port per direction, 2 ports
    # per torus dimension: 100 GB/s.
    # DCN, derived: "2 x 100 Gbps NIC" per host / "8 chips per host" = 25 Gb/s per chip.
    # "TPU Pod size 256 chips" is the ICI domain.
    # "2D torus": a v5e-256 slice is 16x16.
    "tpu-v5e": DeviceSpec(
        "tpu-v5e", _flops(197e12, 197e12, 197e12), TPU_USABLE_GIB["tpu-v5e"] * GIB, 819e9,
        100e9, _ICI_HOP, 3.125e9, _DCN_HOP, devices_per_node=256, torus_dims=2, torus_side=16, **_TPU_TIME,
    ),
    # TPU v5p (Cloud TPU docs, "TPU v5p"): "459 TFLOPs" bf16 per chip (and FP8 at the same
    # rate), float32/float16 as for v4; "95 GB, 2765 GBps" HBM2e, of which `TPU_USABLE_GIB`.
    # ICI, derived: "1200 GBps" bidirectional per chip over the 6 ports of a "3D torus" =
    # 100 GB/s per port per direction, 2 ports per torus dimension: 200 GB/s. DCN: "50
    # Gbps" per chip. "8960 chips" per pod is the ICI domain; slices are built of 4x4x4
    # cubes. Note: a "v5p-N" slice name counts TensorCores, two per chip.
    "tpu-v5p": DeviceSpec(
        "tpu-v5p", _flops(459e12, 459e12, 459e12), TPU_USABLE_GIB["tpu-v5p"] * GIB, 2765e9,
        200e9, _ICI_HOP, 6.25e9, _DCN_HOP, devices_per_node=8960, torus_dims=3, torus_side=4, **_TPU_TIME,
    ),
    # The 8 simulated host devices of the tests (--xla_force_host_platform_device_count=8).
    # NOMINAL figures, not a performance model, enough to rank plans on one host: 30 GFLOP/s
    # per device for every float dtype (XLA:CPU computes bf16/f16 through f32), 8 GB of host
    # RAM each, ~20 GB/s DRAM, copies at 10 GB/s (a memcpy reads and writes) with 10 us per
    # step (a thread rendezvous); one shared memory, so inter = intra. XLA:CPU lowers
    # reduce-scatter to an all-reduce and a slice, schedules breadth first
    # (`xla_cpu_enable_concurrency_optimized_scheduler`, on by default) and lays an
    # all-gather's result out with the gathered dim major.
    "cpu": DeviceSpec(
        "cpu", _flops(30e9, 30e9, 30e9), 8e9, 20e9,
        10e9, 10e-6, 10e9, 10e-6, devices_per_node=8, reduce_scatter=False, breadth_first=True,
        gather_copies=True,
    ),
}

_ALIASES = {
    **dict.fromkeys(("h100-sxm", "h100-sxm5", "h100-80gb", "h100-sxm-80gb", "h100-sxm5-80gb"), "h100"),
    **dict.fromkeys(("h200-sxm", "h200-141gb", "h200-sxm-141gb"), "h200"),
    **dict.fromkeys(("a100-sxm", "a100-sxm4", "a100-80gb", "a100-sxm-80gb", "a100-sxm4-80gb"), "a100"),
    **dict.fromkeys(("p4de", "p4de.24xlarge"), "a100-efa"),
    **dict.fromkeys(("v100-sxm2", "v100-32gb", "v100-sxm2-32gb"), "v100"),
    **dict.fromkeys(("tpuv4", "v4"), "tpu-v4"),
    **dict.fromkeys(("tpuv5e", "v5e", "tpu-v5-lite", "v5litepod"), "tpu-v5e"),
    **dict.fromkeys(("tpuv5p", "v5p"), "tpu-v5p"),
    "host": "cpu",
}


def _load(path: str) -> DeviceSpec:
    try:
        if path.lower().endswith(".toml"):
            with open(path, "rb") as f:
                data = tomllib.load(f)
        else:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
    except (OSError, ValueError) as e:  # both decode errors are ValueErrors
        raise DeviceError(f"cannot read device file {path!r}: {e}") from e
    try:
        return DeviceSpec.from_dict(data)
    except DeviceError as e:
        raise DeviceError(f"{path}: {e}") from e


def get_device(device) -> DeviceSpec:
    """A `DeviceSpec` from a spec (returned as is), a preset name, or a file path.

    Names are case-insensitive, with '_' and '-' alike, and take aliases such as
    'h100-sxm', 'a100-80gb' or 'tpu_v4'. A path ending in .json or .toml holds
    `DeviceSpec.to_dict()`. Anything else raises `DeviceError` listing the presets.
    """
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, (str, os.PathLike)):
        s = os.fspath(device)
        if isinstance(s, str) and s.lower().endswith((".json", ".toml")):
            return _load(s)
        if isinstance(device, str):
            key = "-".join(s.strip().lower().replace("_", "-").split())
            key = key.removeprefix("nvidia-")
            key = _ALIASES.get(key, key)
            if key in PRESETS:
                return PRESETS[key]
    raise DeviceError(
        f"unknown device {device!r}: expected a preset name ({', '.join(PRESETS)}), "
        "a .json/.toml file path, or a DeviceSpec"
    )


_LEVELS = ("intra", "inter")


def link_levels(mesh_axes, device: DeviceSpec | str, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """Map each mesh axis to 'intra' or 'inter' (the link its collectives run over).

    `mesh_axes` is ((name, size), ...) in mesh order (a `Mesh.shape` mapping also works).
    Device ids are laid out row-major over the mesh, last axis fastest (as `jax.make_mesh`
    does), and consecutive ids fill a node. An axis with stride s (product of the later
    axes' sizes) and size n is intra when every group of devices differing only along it
    lies in one node: s*n <= devices_per_node and devices_per_node % (s*n) == 0. Size-1
    axes are intra. `overrides` ({axis: level}) wins over the rule. `device` is anything
    `get_device` takes.
    """
    items = list(mesh_axes.items() if isinstance(mesh_axes, Mapping) else mesh_axes)
    names = [a for a, _ in items]
    if len(set(names)) != len(names):
        raise DeviceError(f"duplicate mesh axis names in {names}")
    dpn = get_device(device).devices_per_node
    levels: dict[str, str] = {}
    stride = 1
    for axis, size in reversed(items):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise DeviceError(f"mesh axis {axis!r} has bad size {size!r}")
        span = stride * int(size)
        levels[axis] = "intra" if size == 1 or (span <= dpn and dpn % span == 0) else "inter"
        stride = span
    for axis, level in (overrides or {}).items():
        if axis not in levels:
            raise DeviceError(f"override names unknown mesh axis {axis!r}; mesh axes: {', '.join(names)}")
        if level not in _LEVELS:
            raise DeviceError(f"override for axis {axis!r} has unknown level {level!r}; allowed: {', '.join(_LEVELS)}")
        levels[axis] = level
    return {a: levels[a] for a in names}
