"""Device descriptions: presets, dtype lookup, file round trips, errors, link levels."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from search.cost._device import PRESETS, DeviceError, DeviceSpec, get_device, link_levels


def _toml(d: dict) -> str:
    """A minimal TOML writer for `to_dict()`: scalars first, then the peak_flops table."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v) if isinstance(v, str) else repr(v)

    lines = [f"{k} = {value(v)}" for k, v in d.items() if k != "peak_flops"]
    lines += ["", "[peak_flops]"] + [f"{k} = {value(v)}" for k, v in d["peak_flops"].items()]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- presets


def test_presets_are_the_expected_set_and_named_after_their_key():
    assert set(PRESETS) == {"h100", "h200", "a100", "a100-efa", "v100", "tpu-v4", "tpu-v5e", "tpu-v5p", "cpu"}
    for key, spec in PRESETS.items():
        assert spec.name == key
        assert get_device(key) is spec


@pytest.mark.parametrize(
    "alias, key",
    [
        ("H100", "h100"), ("h100-sxm", "h100"), ("H100_SXM5_80GB", "h100"), ("nvidia-h100", "h100"),
        ("h200-sxm", "h200"), ("a100-80gb", "a100"), ("A100_SXM4_80GB", "a100"), ("p4de.24xlarge", "a100-efa"),
        ("v100-sxm2", "v100"), ("tpu_v4", "tpu-v4"), ("TPU-V4", "tpu-v4"), ("v5e", "tpu-v5e"),
        ("tpu_v5e", "tpu-v5e"), (" cpu ", "cpu"),
    ],
)
def test_aliases_resolve(alias, key):
    assert get_device(alias) is PRESETS[key]


def test_spec_passes_through():
    spec = dataclasses.replace(PRESETS["a100"], name="custom")
    assert get_device(spec) is spec


def test_every_preset_has_sane_figures():
    for spec in PRESETS.values():
        table = dict(spec.peak_flops)
        assert {"float32", "bfloat16", "float16"} <= set(table)
        assert spec.inter_bandwidth <= spec.intra_bandwidth
        assert spec.intra_latency <= spec.inter_latency
        assert spec.hbm_bandwidth > 0 and spec.hbm_bytes > 0


def test_headline_figures():
    h100 = PRESETS["h100"]
    assert h100.flops_for("bfloat16") == pytest.approx(989.5e12)
    assert h100.hbm_bandwidth == pytest.approx(3.35e12)
    assert h100.intra_bandwidth == pytest.approx(450e9) and h100.inter_bandwidth == pytest.approx(50e9)
    assert PRESETS["a100"].intra_bandwidth == pytest.approx(300e9)
    # AWS's A100 nodes: the same board, 400 Gb/s of EFA an instance of 8 GPUs.
    efa = PRESETS["a100-efa"]
    assert efa.inter_bandwidth == pytest.approx(6.25e9) and PRESETS["a100"].inter_bandwidth == pytest.approx(25e9)
    assert dataclasses.replace(efa, name="a100", inter_bandwidth=25e9) == PRESETS["a100"]
    assert PRESETS["v100"].intra_bandwidth == pytest.approx(150e9)
    # The memory a step may use: the datasheet's GiB, less the runtime's share.
    assert PRESETS["h200"].hbm_bytes == pytest.approx(141 * 2**30 * 0.9)
    assert PRESETS["h100"].hbm_bytes == PRESETS["a100"].hbm_bytes == pytest.approx(72 * 2**30)
    # A TPU's: what XLA:TPU's out-of-memory errors say a program may use.
    assert PRESETS["tpu-v5p"].hbm_bytes == pytest.approx(95.74 * 2**30)
    assert PRESETS["tpu-v5e"].hbm_bytes == pytest.approx(15.75 * 2**30)
    assert PRESETS["tpu-v5e"].flops_for(jnp.bfloat16) == pytest.approx(197e12)
    assert PRESETS["tpu-v4"].flops_for(jnp.bfloat16) == pytest.approx(275e12)


def test_cpu_preset_is_nominal_and_has_no_reduce_scatter():
    cpu = PRESETS["cpu"]
    assert cpu.devices_per_node == 8
    assert cpu.reduce_scatter is False and cpu.breadth_first is True and cpu.gather_copies is True
    assert 10e9 <= cpu.flops_for(np.float32) <= 100e9
    assert all(spec.reduce_scatter and not spec.breadth_first and not spec.gather_copies
               for key, spec in PRESETS.items() if key != "cpu")


# ------------------------------------------------------------------------- flops_for


def test_flops_for_picks_the_dtype():
    h100 = PRESETS["h100"]
    bf16 = h100.flops_for(jnp.bfloat16)
    # numpy/JAX dtypes, scalar types, arrays and names all reach the same entry.
    assert bf16 == h100.flops_for("bfloat16") == h100.flops_for(jnp.dtype(jnp.bfloat16))
    assert bf16 == h100.flops_for(jnp.zeros(2, jnp.bfloat16)) == h100.flops_for(jax.ShapeDtypeStruct((2,), jnp.bfloat16))
    f32 = h100.flops_for(np.float32)
    assert f32 == h100.flops_for("float32") == h100.flops_for(np.dtype("float32")) == h100.flops_for("f4")
    # float32 is the TF32 rate (JAX's default f32 dot on Hopper): half of bf16; fp8 doubles bf16.
    assert bf16 == pytest.approx(2 * f32, rel=1e-2)  # datasheet rounding: 1,979 vs 989
    assert h100.flops_for(jnp.float8_e4m3fn) == pytest.approx(2 * bf16)
    assert h100.flops_for(jnp.float8_e5m2) == pytest.approx(2 * bf16)


def test_flops_for_v100_half_is_an_order_of_magnitude_above_float32():
    v100 = PRESETS["v100"]
    assert v100.flops_for(jnp.float16) >= 7 * v100.flops_for(jnp.float32)
    # No bf16 tensor cores on Volta: bf16 runs at the float32 rate.
    assert v100.flops_for(jnp.bfloat16) == v100.flops_for(jnp.float32)


def test_tpu_float32_runs_at_the_bf16_rate():
    for key in ("tpu-v4", "tpu-v5e"):
        spec = PRESETS[key]
        assert spec.flops_for(jnp.float32) == spec.flops_for(jnp.bfloat16)


@pytest.mark.parametrize("dtype", [np.int32, jnp.int8, np.bool_, np.float64, "float8_e4m3fn", "complex64", "nonsense"])
def test_flops_for_falls_back_to_float32(dtype):
    a100 = PRESETS["a100"]  # no float8 on Ampere either
    assert a100.flops_for(dtype) == a100.flops_for(np.float32)


# ----------------------------------------------------------------- dicts and files


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_dict_round_trip(key):
    spec = PRESETS[key]
    d = spec.to_dict()
    assert isinstance(d["peak_flops"], dict)
    assert d["peak_flops"]["float32"] == spec.flops_for("float32")
    assert DeviceSpec.from_dict(d) == spec
    assert DeviceSpec.from_dict(json.loads(json.dumps(d))) == spec


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_json_and_toml_files_round_trip(tmp_path, key):
    spec = dataclasses.replace(PRESETS[key], name=f"my-{key}")
    (tmp_path / "dev.json").write_text(json.dumps(spec.to_dict()))
    (tmp_path / "dev.toml").write_text(_toml(spec.to_dict()))
    assert get_device(str(tmp_path / "dev.json")) == spec
    assert get_device(tmp_path / "dev.toml") == spec  # a Path works too


def test_toml_with_integer_figures_and_default_reduce_scatter(tmp_path):
    d = PRESETS["a100"].to_dict()
    del d["reduce_scatter"]
    d["hbm_bytes"] = 77_309_411_328  # 72 GiB: TOML integers are accepted and become floats
    (tmp_path / "a.TOML").write_text(_toml(d))
    spec = get_device(tmp_path / "a.TOML")
    assert spec == PRESETS["a100"] and isinstance(spec.hbm_bytes, float) and spec.reduce_scatter


def test_from_dict_names_unknown_and_missing_keys():
    d = PRESETS["h100"].to_dict()
    d["nvlink"] = 1.0
    del d["hbm_bandwidth"]
    with pytest.raises(DeviceError) as e:
        DeviceSpec.from_dict(d)
    msg = str(e.value)
    assert "nvlink" in msg and "hbm_bandwidth" in msg
    assert "allowed keys" in msg and "intra_latency" in msg and "devices_per_node" in msg


@pytest.mark.parametrize(
    "field, value",
    [
        ("hbm_bandwidth", -1.0), ("hbm_bandwidth", "fast"), ("intra_latency", 0.0), ("hbm_bytes", True),
        ("devices_per_node", 0), ("devices_per_node", 8.0), ("reduce_scatter", "yes"), ("breadth_first", 1), ("name", ""),
        ("peak_flops", {"bfloat16": 1e12}), ("peak_flops", {"float32": float("nan")}), ("peak_flops", [1, 2]),
    ],
)
def test_bad_values_raise_device_error(field, value):
    d = PRESETS["h100"].to_dict()
    d[field] = value
    with pytest.raises(DeviceError):
        DeviceSpec.from_dict(d)


def test_bad_files_raise_device_error(tmp_path):
    with pytest.raises(DeviceError, match="cannot read"):
        get_device(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DeviceError, match="cannot read"):
        get_device(tmp_path / "broken.json")
    (tmp_path / "broken.toml").write_text("name = = 1")
    with pytest.raises(DeviceError, match="cannot read"):
        get_device(tmp_path / "broken.toml")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(DeviceError, match="mapping"):
        get_device(tmp_path / "list.json")
    (tmp_path / "extra.json").write_text(json.dumps({**PRESETS["cpu"].to_dict(), "colour": "blue"}))
    with pytest.raises(DeviceError, match="colour") as e:
        get_device(tmp_path / "extra.json")
    assert "extra.json" in str(e.value)


@pytest.mark.parametrize("bad", ["h1000", "gpu", "", "a100.yaml", 3, None])
def test_unknown_devices_list_the_presets(bad):
    with pytest.raises(DeviceError) as e:
        get_device(bad)
    msg = str(e.value)
    assert repr(bad) in msg
    for key in PRESETS:
        assert key in msg


def test_device_error_is_a_value_error():
    assert issubclass(DeviceError, ValueError)


def test_spec_is_frozen_and_hashable():
    spec = PRESETS["h100"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.hbm_bytes = 1.0
    assert hash(spec) == hash(DeviceSpec.from_dict(spec.to_dict()))


# ---------------------------------------------------------------------- link_levels


def _gpu8():
    return PRESETS["h100"]


def test_link_levels_small_mesh_fits_in_a_node():
    assert link_levels((("data", 2), ("model", 4)), _gpu8()) == {"data": "intra", "model": "intra"}


def test_link_levels_model_fills_the_node():
    assert link_levels((("data", 4), ("model", 8)), _gpu8()) == {"data": "inter", "model": "intra"}


def test_link_levels_data_spans_nodes():
    assert link_levels((("data", 16), ("model", 4)), _gpu8()) == {"data": "inter", "model": "intra"}


def test_link_levels_three_axes_on_four_per_node():
    dev = dataclasses.replace(_gpu8(), devices_per_node=4)
    assert link_levels((("a", 2), ("b", 2), ("c", 2)), dev) == {"a": "inter", "b": "intra", "c": "intra"}


def test_link_levels_groups_straddling_nodes_are_inter():
    # Axis of size 3 with stride 1 on 8-device nodes: the group {6, 7, 8} crosses a node.
    assert link_levels((("x", 2), ("y", 3)), _gpu8()) == {"x": "inter", "y": "inter"}


def test_link_levels_size_one_axes_are_intra():
    levels = link_levels((("pipe", 1), ("data", 16), ("unit", 1), ("model", 8)), _gpu8())
    assert levels == {"pipe": "intra", "data": "inter", "unit": "intra", "model": "intra"}


def test_link_levels_keeps_mesh_order_and_takes_mappings_and_names():
    levels = link_levels({"data": 4, "model": 8}, "h100")
    assert list(levels) == ["data", "model"]
    assert levels == {"data": "inter", "model": "intra"}


def test_link_levels_matches_a_brute_force_check():
    # Enumerate device ids row-major and test the definition directly.
    dev = dataclasses.replace(_gpu8(), devices_per_node=4)
    for shape in [(2, 4), (4, 2), (8,), (2, 2, 2), (2, 3), (3, 4), (1, 16), (4, 1, 2), (6, 2)]:
        ids = np.arange(int(np.prod(shape))).reshape(shape)
        axes = tuple((f"a{i}", n) for i, n in enumerate(shape))
        levels = link_levels(axes, dev)
        for i, (name, _) in enumerate(axes):
            groups = np.moveaxis(ids, i, -1).reshape(-1, shape[i])
            same_node = all(len(set(g // 4)) == 1 for g in groups)
            assert levels[name] == ("intra" if same_node else "inter"), (shape, name)


def test_link_levels_overrides():
    axes = (("data", 4), ("model", 8))
    assert link_levels(axes, _gpu8(), {"data": "intra"}) == {"data": "intra", "model": "intra"}
    assert link_levels(axes, _gpu8(), {"model": "inter"}) == {"data": "inter", "model": "inter"}
    with pytest.raises(DeviceError, match="unknown mesh axis 'pipe'.*data, model"):
        link_levels(axes, _gpu8(), {"pipe": "intra"})
    with pytest.raises(DeviceError, match="unknown level 'nvlink'.*intra, inter"):
        link_levels(axes, _gpu8(), {"data": "nvlink"})


def test_link_levels_rejects_bad_meshes():
    with pytest.raises(DeviceError, match="duplicate"):
        link_levels((("data", 2), ("data", 4)), _gpu8())
    with pytest.raises(DeviceError, match="bad size"):
        link_levels((("data", 0),), _gpu8())
