"""zpipe.models: split-vs-full equivalence, seeding, weights files, specs, adapters."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zpipe._errors import ConfigError, ModelSpecError
from zpipe.models import (
    LayerSequence,
    ModelSpec,
    available_presets,
    build_full_model,
    load_layer_sequence,
    run_units,
    save_weights,
    unit_param_bytes,
)
from zpipe.models import weights as weights_module
from zpipe.models.examples import tiny_residual, tiny_sequential
from zpipe.models.transformer import TransformerSequence

TINY_PRESETS = ["vit-tiny", "bert-tiny", "mlp-small", "cnn-small"]
SEQUENTIAL_CONFIG: dict[str, Any] = {
    "factory": "zpipe.models.examples:tiny_sequential",
    "input_shape": [8],
}
TRACED_CONFIG: dict[str, Any] = {
    "factory": "zpipe.models.examples:tiny_residual",
    "input_shape": [8],
    "microbatch_size": 4,
}
MICROBATCH = 4


def tiny_spec(name: str, *, seed: int = 0, weights: str | None = None) -> ModelSpec:
    if name == "sequential":
        return ModelSpec("sequential", SEQUENTIAL_CONFIG, seed=seed, weights=weights)
    if name == "traced":
        return ModelSpec("traced", TRACED_CONFIG, seed=seed, weights=weights)
    return ModelSpec.preset(name, seed=seed, weights=weights)


ALL_TINY = [*TINY_PRESETS, "sequential", "traced"]


def assert_outputs_close(
    got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], *, atol: float = 1e-6
) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=atol, rtol=1e-5)


# --- splitting: stages chained == the full model ----------------------------------------


@pytest.mark.parametrize("name", ALL_TINY)
def test_two_stage_split_matches_full_model_at_every_cut(name: str) -> None:
    spec = tiny_spec(name, seed=5)
    sequence = load_layer_sequence(spec)
    inputs = sequence.example_input(MICROBATCH, seed=1)
    with torch.no_grad():
        want = build_full_model(spec)(*inputs)
        for cut in range(1, sequence.num_units):
            middle = run_units(sequence.build_units(0, cut), inputs)
            got = run_units(sequence.build_units(cut, sequence.num_units), middle)
            assert_outputs_close(got, want)


def test_transformer_cuts_inside_a_block_carry_the_residual() -> None:
    spec = ModelSpec.preset("vit-tiny", seed=2)
    sequence = load_layer_sequence(spec)
    (images,) = sequence.example_input(2)
    with torch.no_grad():
        after_attn = run_units(sequence.build_units(0, 2), (images,))  # embed, block0.attn
        after_proj = run_units(sequence.build_units(2, 3), after_attn)
        after_fc1 = run_units(sequence.build_units(3, 4), after_proj)
    tokens = (32 // 8) ** 2 + 1
    assert [t.shape for t in after_attn] == [(2, tokens, 32), (2, tokens, 32)]
    assert [t.shape for t in after_proj] == [(2, tokens, 32)]
    assert [t.shape for t in after_fc1] == [(2, tokens, 64), (2, tokens, 32)]
    # The residual that rides along is the block's input.
    torch.testing.assert_close(after_fc1[1], after_proj[0])


def test_vit_units_compute_a_pre_ln_vit() -> None:
    # Split-vs-full tests cannot see a wrong architecture; this compares with an
    # independent pre-LN ViT written with nn.MultiheadAttention and the units' weights.
    sequence = load_layer_sequence(ModelSpec.preset("vit-tiny", seed=4))
    units: Any = sequence.build_units(0, sequence.num_units)
    (images,) = sequence.example_input(2)
    embed, head = units[0], units[-1]
    with torch.no_grad():
        patches = embed.proj(images).flatten(2).transpose(1, 2)
        cls = embed.cls_token.expand(2, -1, -1)
        x = torch.cat([cls, patches], dim=1) + embed.pos_embed
        for block in range(2):
            attn, proj, fc1, fc2 = units[1 + 4 * block : 5 + 4 * block]
            mha = nn.MultiheadAttention(32, 2, batch_first=True)
            mha.in_proj_weight.copy_(attn.qkv.weight)
            mha.in_proj_bias.copy_(attn.qkv.bias)
            mha.out_proj.weight.copy_(proj.proj.weight)
            mha.out_proj.bias.copy_(proj.proj.bias)
            normed = attn.norm(x)
            x = x + mha(normed, normed, normed, need_weights=False)[0]
            x = x + fc2.fc2(torch.nn.functional.gelu(fc1.fc1(fc1.norm(x))))
        want = head.classifier(head.norm(x)[:, 0])
        got = run_units(units, (images,))
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["vit-tiny", "bert-tiny"])
def test_four_stage_split_matches_full_model(name: str) -> None:
    spec = ModelSpec.preset(name, seed=9)
    sequence = load_layer_sequence(spec)
    inputs = sequence.example_input(3)
    bounds = [0, 2, 5, 8, sequence.num_units]  # cuts after attn, after fc1, after proj
    with torch.no_grad():
        want = build_full_model(spec)(*inputs)
        values = inputs
        for start, end in itertools.pairwise(bounds):
            values = run_units(sequence.build_units(start, end), values)
    assert_outputs_close(values, want)


@pytest.mark.parametrize("name", ALL_TINY)
def test_outputs_depend_on_the_input(name: str) -> None:
    # Guards the equivalence tests against a degenerate model that ignores its input.
    spec = tiny_spec(name)
    sequence = load_layer_sequence(spec)
    model = build_full_model(spec)
    with torch.no_grad():
        first = model(*sequence.example_input(MICROBATCH, seed=0))
        second = model(*sequence.example_input(MICROBATCH, seed=1))
    assert not torch.allclose(first[0], second[0], atol=1e-3)
    assert torch.isfinite(first[0]).all()


def test_run_units_normalises_outputs() -> None:
    out = run_units([nn.Identity()], (torch.ones(2),))
    assert isinstance(out, tuple) and len(out) == 1
    assert run_units([], (torch.ones(1), torch.zeros(1)))[1].item() == 0.0

    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> object:
            return {"x": x}

    with pytest.raises(TypeError, match="tuple of Tensors"):
        run_units([Bad()], (torch.ones(1),))


# --- seeding: a stage builds only its units, with the full build's weights ----------------


@pytest.mark.parametrize("name", ALL_TINY)
def test_slice_parameters_equal_full_build(name: str) -> None:
    spec = tiny_spec(name, seed=11)
    sequence = load_layer_sequence(spec)
    full = build_full_model(spec).state_dict()
    n = sequence.num_units
    compared = set()
    for start, end in [(0, 1), (1, n - 1), (n - 1, n), (n // 2, n)]:
        units = sequence.build_units(start, end)
        assert len(units) == end - start
        for offset, unit in enumerate(units):
            state = unit.state_dict()
            for key, tensor in state.items():
                full_key = f"units.{start + offset}.{key}"
                assert torch.equal(tensor, full[full_key]), full_key
                compared.add(full_key)
            assert sequence.unit_param_keys(start + offset) == [
                f"units.{start + offset}.{key}" for key in state
            ]
    assert compared == set(full)  # every unit's state was checked


@pytest.mark.parametrize("name", ALL_TINY)
def test_units_come_in_eval_mode_and_names_match(name: str) -> None:
    sequence = load_layer_sequence(tiny_spec(name))
    units = sequence.build_units(0, sequence.num_units)
    assert not any(m.training for unit in units for m in unit.modules())
    assert len(sequence.unit_names()) == sequence.num_units == len(units)
    assert isinstance(sequence, LayerSequence)


def test_build_units_constructs_only_the_requested_units(monkeypatch: pytest.MonkeyPatch) -> None:
    sequence = load_layer_sequence(ModelSpec.preset("vit-tiny"))
    built: list[int] = []
    original = TransformerSequence.make_unit

    def counting(self: TransformerSequence, index: int) -> nn.Module:
        built.append(index)
        return original(self, index)

    monkeypatch.setattr(TransformerSequence, "make_unit", counting)
    sequence.build_units(3, 6)
    assert built == [3, 4, 5]


def test_seed_changes_weights_and_leaves_global_rng_alone() -> None:
    def flat(seed: int) -> torch.Tensor:
        units = load_layer_sequence(ModelSpec.preset("vit-tiny", seed=seed)).build_units(1, 2)
        return torch.cat([p.flatten() for p in units[0].parameters()])

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = flat(0)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(first, flat(0))
    assert not torch.equal(first, flat(1))


def test_same_type_units_get_different_weights() -> None:
    sequence = load_layer_sequence(ModelSpec.preset("vit-tiny"))
    block0, block1 = sequence.build_units(1, 2)[0], sequence.build_units(5, 6)[0]
    assert not torch.equal(block0.state_dict()["qkv.weight"], block1.state_dict()["qkv.weight"])


# --- weights files -----------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("name", ["vit-tiny", "cnn-small", "traced"])
def test_weights_round_trip(tmp_path: Path, suffix: str, name: str) -> None:
    path = tmp_path / f"model{suffix}"
    source = build_full_model(tiny_spec(name, seed=1))
    save_weights(source, path)
    loaded_spec = tiny_spec(name, seed=2, weights=str(path))
    sequence = load_layer_sequence(loaded_spec)
    inputs = sequence.example_input(MICROBATCH)
    with torch.no_grad():
        want = source(*inputs)
        other = build_full_model(tiny_spec(name, seed=2))(*inputs)
        got = run_units(sequence.build_units(0, sequence.num_units), inputs)
        cut = sequence.num_units // 2
        split = run_units(
            sequence.build_units(cut, sequence.num_units),
            run_units(sequence.build_units(0, cut), inputs),
        )
    assert not torch.allclose(other[0], want[0])  # the file, not the seed, decides
    assert_outputs_close(got, want)
    assert_outputs_close(split, want)
    assert build_full_model(loaded_spec).state_dict().keys() == source.state_dict().keys()


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_stage_reads_only_its_own_keys(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = ModelSpec.preset("vit-tiny", seed=3)
    sequence = load_layer_sequence(spec)
    # A file with units 3..5 only, as a stage that owns those units might receive.
    path = tmp_path / f"slice{suffix}"
    save_weights(sequence.build_units(3, 6), path, start=3)
    read: list[str] = []
    for reader in (weights_module._SafetensorsReader, weights_module._StateDictReader):
        original = reader.get

        def recording(self: Any, key: str, _original: Any = original) -> torch.Tensor:
            read.append(key)
            return _original(self, key)

        monkeypatch.setattr(reader, "get", recording)

    loaded = load_layer_sequence(ModelSpec.preset("vit-tiny", seed=7, weights=str(path)))
    units = loaded.build_units(4, 6)
    assert read and all(key.startswith(("units.4.", "units.5.")) for key in read)
    for offset, unit in enumerate(sequence.build_units(4, 6)):
        for key, tensor in unit.state_dict().items():
            assert torch.equal(units[offset].state_dict()[key], tensor)
    with pytest.raises(ModelSpecError, match=r"slice.*no key 'units\.1\.norm\.weight'"):
        loaded.build_units(1, 2)


def test_missing_key_error_names_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "partial.safetensors"
    unit1 = load_layer_sequence(ModelSpec.preset("mlp-small")).build_units(1, 2)
    save_weights(unit1, path, start=1)
    spec = ModelSpec.preset("mlp-small", weights=str(path))
    with pytest.raises(ModelSpecError) as caught:
        load_layer_sequence(spec).build_units(0, 2)
    assert "units.0.linear.weight" in str(caught.value)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_shape_mismatch_error_names_key_and_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"mlp{suffix}"
    save_weights(build_full_model(ModelSpec("mlp", {"dims": [4, 8, 2]})), path)
    spec = ModelSpec("mlp", {"dims": [4, 6, 2]}, weights=str(path))
    with pytest.raises(ModelSpecError) as caught:
        build_full_model(spec)
    message = str(caught.value)
    assert "units.0.linear.weight" in message and str(path) in message
    assert "(8, 4)" in message and "(6, 4)" in message


def test_unexpected_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "extra.pt"
    state = build_full_model(ModelSpec("mlp", {"dims": [4, 2]})).state_dict()
    torch.save({**state, "units.0.linear.extra": torch.zeros(1)}, path)
    with pytest.raises(ModelSpecError, match=r"units\.0\.linear\.extra"):
        build_full_model(ModelSpec("mlp", {"dims": [4, 2]}, weights=str(path)))


class _NotWeights:
    pass


@pytest.mark.parametrize(
    ("filename", "payload", "match"),
    [
        ("missing.safetensors", None, "does not exist"),
        ("weights.npz", b"", "unknown suffix"),
        ("garbage.safetensors", b"not a safetensors file", "cannot read safetensors"),
        ("list.pt", [torch.zeros(1)], "flat dict"),
        ("object.pt", {"units.0.linear.weight": _NotWeights()}, "cannot read weights file"),
    ],
)
def test_bad_weights_files(tmp_path: Path, filename: str, payload: object, match: str) -> None:
    path = tmp_path / filename
    if isinstance(payload, bytes):
        path.write_bytes(payload)
    elif payload is not None:
        torch.save(payload, path)  # the object payload must be refused: weights_only=True
    with pytest.raises(ModelSpecError, match=match):
        build_full_model(ModelSpec("mlp", {"dims": [4, 2]}, weights=str(path)))


def test_save_weights_rejects_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match="suffix"):
        save_weights(nn.Linear(2, 2), tmp_path / "w.txt")


# --- specs and presets -------------------------------------------------------------------


@pytest.mark.parametrize("name", available_presets())
def test_every_preset_round_trips_through_msgpack(name: str) -> None:
    spec = ModelSpec.preset(name, seed=42)
    data = msgpack.unpackb(msgpack.packb(spec.to_dict()), raw=False)
    again = ModelSpec.from_dict(data)
    assert again == spec and hash(again) == hash(spec)
    assert again.to_dict() == spec.to_dict()


_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(
    config=st.dictionaries(st.text(max_size=6), _plain, max_size=5),
    seed=st.integers(min_value=0, max_value=2**63 - 1),
    weights=st.none() | st.text(max_size=10),
)
def test_spec_round_trip_property(config: dict[str, Any], seed: int, weights: str | None) -> None:
    spec = ModelSpec("mlp", config, seed=seed, weights=weights)
    wire = msgpack.unpackb(msgpack.packb(spec.to_dict()), raw=False)
    assert ModelSpec.from_dict(wire) == spec
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_spec_copies_the_callers_config() -> None:
    config: dict[str, Any] = {"dims": [4, 2]}
    spec = ModelSpec("mlp", config)
    config["dims"].append(3)
    assert spec.config["dims"] == [4, 2]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"config": {}}, "needs a 'family'"),
        ({"family": "mlp", "config": {}, "sead": 1}, "unknown model spec keys"),
        ({"family": 3, "config": {}}, "family"),
        ({"family": "mlp", "config": [1]}, "config must be a mapping"),
        ({"family": "mlp", "config": {}, "seed": "1"}, "seed must be an integer"),
        ({"family": "mlp", "config": {}, "seed": True}, "seed must be an integer"),
        ({"family": "mlp", "config": {}, "seed": -1}, "seed must be in"),
        ({"family": "mlp", "config": {}, "weights": 5}, "weights"),
        ({"family": "mlp", "config": {"x": object()}}, r"config\.x is a object"),
        ({"family": "mlp", "config": {"x": {1: 2}}}, "non-string key"),
        ({"family": "mlp", "config": {"x": [float("nan")]}}, "finite"),
        ({"family": "mlp", "config": {"x": 2**70}}, "64 bits"),
    ],
)
def test_from_dict_rejects_bad_specs(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelSpecError, match=match):
        ModelSpec.from_dict(data)


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ModelSpecError, match="must be a mapping"):
        ModelSpec.from_dict([("family", "mlp")])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ModelSpec.preset("vit-gigantic"), r"unknown model preset.*vit-base"),
        (lambda: ModelSpec.preset("vit-tiny", num_layer=3), r"unknown transformer config keys"),
        (lambda: ModelSpec.preset("vit-tiny", vocab_size=3), "do not apply"),
        (lambda: ModelSpec.preset("vit-tiny", heads=3), "divisible by heads"),
        (lambda: ModelSpec.preset("vit-tiny", image_size=30), "divisible by patch"),
        (lambda: ModelSpec.preset("vit-tiny", num_layers="2"), "expected an integer"),
        (lambda: ModelSpec.preset("bert-tiny", seq_len=32), "max_positions"),
        (lambda: ModelSpec.preset("mlp-small", activation="tanh"), "must be one of"),
        (lambda: ModelSpec.preset("cnn-small", pool=[True]), "one entry per conv"),
        (lambda: load_layer_sequence(ModelSpec("rnn", {})), r"unknown model family.*transformer"),
        (lambda: load_layer_sequence(ModelSpec("mlp", {})), "needs the key 'dims'"),
        (lambda: load_layer_sequence(ModelSpec("transformer", {"kind": "gpt"})), "kind"),
    ],
)
def test_bad_presets_and_configs(make: Any, match: str) -> None:
    with pytest.raises(ModelSpecError, match=match):
        make()


def test_preset_overrides() -> None:
    spec = ModelSpec.preset("vit-base", num_layers=2, image_size=32, seed=3)
    sequence = load_layer_sequence(spec)
    assert spec.seed == 3 and spec.config["hidden"] == 768
    assert sequence.num_units == 10
    assert sequence.example_input(2)[0].shape == (2, 3, 32, 32)


def test_example_input_is_deterministic() -> None:
    bert = load_layer_sequence(ModelSpec.preset("bert-tiny"))
    (ids,) = bert.example_input(3, seed=4)
    assert ids.dtype == torch.int64 and ids.shape == (3, 16)
    assert 0 <= ids.min() and ids.max() < 100
    assert torch.equal(ids, bert.example_input(3, seed=4)[0])
    assert not torch.equal(ids, bert.example_input(3, seed=5)[0])
    with pytest.raises(ValueError, match="batch_size"):
        bert.example_input(0)


def test_unit_range_is_checked() -> None:
    sequence = load_layer_sequence(ModelSpec.preset("mlp-small"))
    with pytest.raises(ConfigError, match="outside"):
        sequence.build_units(3, 2)
    with pytest.raises(ConfigError, match="outside"):
        sequence.build_units(0, sequence.num_units + 1)


def test_vit_rejects_wrong_image_size() -> None:
    sequence = load_layer_sequence(ModelSpec.preset("vit-tiny"))
    with pytest.raises(ValueError, match="image_size"):
        run_units(sequence.build_units(0, 1), (torch.zeros(1, 3, 48, 48),))


# --- paper-sized presets, sized on the meta device (nothing allocated) --------------------


@pytest.mark.parametrize(
    ("name", "units", "millions"),
    [
        ("vit-base", 50, 86.6),
        ("vit-large", 98, 304.3),
        ("vit-huge", 130, 632.0),
        ("bert-base", 50, 109.5),
        ("bert-large", 98, 335.1),
    ],
)
def test_paper_presets_have_the_papers_sizes(name: str, units: int, millions: float) -> None:
    sequence = load_layer_sequence(ModelSpec.preset(name))
    assert sequence.num_units == units
    with torch.device("meta"):
        built = sequence.build_units(0, sequence.num_units)
    params = sum(p.numel() for unit in built for p in unit.parameters())
    assert params == pytest.approx(millions * 1e6, rel=0.01)
    assert sum(unit_param_bytes(built)) >= 4 * params


def test_vit_base_block_matches_the_analytic_count() -> None:
    hidden, mlp = 768, 3072
    expected = 4 * hidden**2 + 2 * hidden * mlp + 9 * hidden + mlp  # qkv, proj, fc1, fc2, 2 LNs
    sequence = load_layer_sequence(ModelSpec.preset("vit-base"))
    with torch.device("meta"):
        block = sequence.build_units(1, 5)
    assert sum(unit_param_bytes(block)) == 4 * expected == 4 * 7_087_872
    assert sequence.unit_names()[1:5] == [
        "block0.attn",
        "block0.proj",
        "block0.fc1",
        "block0.fc2",
    ]
    assert sequence.unit_names()[0] == "embed" and sequence.unit_names()[-1] == "head"


# --- mixed precision ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["vit-tiny", "bert-tiny", "cnn-small", "traced"])
def test_bfloat16_autocast_is_close_to_float32(name: str) -> None:
    spec = tiny_spec(name, seed=6)
    sequence = load_layer_sequence(spec)
    inputs = sequence.example_input(MICROBATCH)
    cut = sequence.num_units // 2
    first, second = sequence.build_units(0, cut), sequence.build_units(cut, sequence.num_units)
    with torch.inference_mode():
        want = run_units(second, run_units(first, inputs))[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = run_units(second, run_units(first, inputs))[0]
    assert got.dtype in (torch.bfloat16, torch.float32)
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= 0.05 * scale + 0.05


# --- adapters ----------------------------------------------------------------------------


def test_sequential_adapter_matches_the_users_module() -> None:
    spec = tiny_spec("sequential", seed=8)
    sequence = load_layer_sequence(spec)
    assert sequence.unit_names() == ["linear0", "relu1", "linear2", "gelu3", "linear4"]
    with torch.random.fork_rng():
        torch.manual_seed(8)
        reference = tiny_sequential()
    (x,) = sequence.example_input(5)  # any batch size: nothing was traced
    with torch.no_grad():
        torch.testing.assert_close(build_full_model(spec)(x)[0], reference(x))


def test_traced_adapter_with_skip_connections_matches_the_users_module() -> None:
    spec = tiny_spec("traced", seed=8)
    sequence = load_layer_sequence(spec)
    assert sequence.unit_names() == ["stem", "block1", "block2", "head"]
    with torch.random.fork_rng():
        torch.manual_seed(8)
        reference = tiny_residual().eval()
    (x,) = sequence.example_input(MICROBATCH, seed=3)
    units = sequence.build_units(0, sequence.num_units)
    with torch.no_grad():
        want = reference(x)
        torch.testing.assert_close(run_units(units, (x,))[0], want)
        # The stem's output skips block1, so unit 1 must hand it on next to its own output.
        after_stem = run_units(units[:1], (x,))
        after_block1 = run_units(units[1:2], after_stem)
        assert len(after_block1) == 2
        assert any(torch.equal(t, after_stem[0]) for t in after_block1)
        torch.testing.assert_close(run_units(units[2:], after_block1)[0], want)


def test_traced_adapter_with_explicit_split_points() -> None:
    spec = ModelSpec("traced", {**TRACED_CONFIG, "split_points": ["block2"]}, seed=1)
    sequence = load_layer_sequence(spec)
    assert sequence.num_units == 2 and sequence.unit_names() == ["start", "block2"]
    (x,) = sequence.example_input(MICROBATCH)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        reference = tiny_residual().eval()
    middle = run_units(sequence.build_units(0, 1), (x,))
    assert len(middle) == 2  # block1's output and the stem's skip
    with torch.no_grad():
        torch.testing.assert_close(run_units(sequence.build_units(1, 2), middle)[0], reference(x))


def test_traced_units_refuse_another_microbatch_size() -> None:
    sequence = load_layer_sequence(tiny_spec("traced"))
    units = sequence.build_units(0, sequence.num_units)
    with pytest.raises(ModelSpecError, match="microbatch_size"):
        run_units(units, sequence.example_input(MICROBATCH + 1))


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"factory": "no_colon"}, "package.module:callable"),
        ({"factory": "zpipe_no_such_module_xyz:f"}, "cannot import module"),
        ({"factory": "zpipe.models.examples:nope"}, "has no 'nope'"),
        ({"factory": "zpipe.models.presets:PRESETS"}, "not callable"),
        ({**SEQUENTIAL_CONFIG, "kwarg": {}}, "unknown"),
        ({"factory": "zpipe.models.examples:tiny_sequential"}, "input_shape"),
        ({**SEQUENTIAL_CONFIG, "input_dtype": "complex64"}, "must be one of"),
        ({**SEQUENTIAL_CONFIG, "input_range": [5, 5]}, "low < high"),
    ],
)
def test_bad_factory_configs_fail_at_load(config: dict[str, Any], match: str) -> None:
    for family in ("sequential", "traced"):
        full = {**config, "microbatch_size": 2} if family == "traced" else config
        with pytest.raises(ModelSpecError, match=match):
            load_layer_sequence(ModelSpec(family, full))


@pytest.mark.parametrize(
    ("family", "config", "match"),
    [
        ("sequential", {**SEQUENTIAL_CONFIG, "kwargs": {"widht": 3}}, "raised TypeError"),
        (
            "sequential",
            {**SEQUENTIAL_CONFIG, "factory": "zpipe.models.examples:tiny_residual"},
            "needs an nn.Sequential",
        ),
        ("sequential", {**SEQUENTIAL_CONFIG, "factory": "builtins:dict"}, "not an nn.Module"),
        ("traced", {**TRACED_CONFIG, "split_points": ["block9"]}, "not a submodule"),
    ],
)
def test_bad_factories_fail_at_build(family: str, config: dict[str, Any], match: str) -> None:
    sequence = load_layer_sequence(ModelSpec(family, config))
    with pytest.raises(ModelSpecError, match=match):
        sequence.build_units(0, 1)


def test_integer_input_for_adapters() -> None:
    config = {**SEQUENTIAL_CONFIG, "input_dtype": "int64", "input_range": [3, 7]}
    (x,) = load_layer_sequence(ModelSpec("sequential", config)).example_input(50)
    assert x.dtype == torch.int64 and x.shape == (50, 8)
    assert 3 <= x.min() and x.max() < 7
