"""A causal LM stage's own duties: tied weights across stages, reading only its own
tensors, the KV cache's budget, refusals and frees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch

from tests._support.causal_lm import SPLITS, build_stages, hf_model, write_checkpoint
from zpipe._errors import ConfigError, KvCacheFullError, ModelSpecError, SequenceStateError
from zpipe.models import ModelSpec, build_full_model, count_units, load_layer_sequence, save_weights
from zpipe.models.causal_lm import (
    CausalLmStage,
    SequenceChunk,
    causal_lm_spec,
    chain_forward,
    kv_bytes_per_token_per_block,
    read_causal_lm_config,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(hf_model("gpt2"), tmp_path_factory.mktemp("gpt2"))


class _ReadCounter:
    """Wraps safetensors.safe_open: which files were opened, which tensors were read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[str] = []
        self.read: list[str] = []
        real = safetensors.safe_open
        counter = self

        class Handle:
            def __init__(self, path: str, **kwargs: Any) -> None:
                counter.opened.append(Path(path).name)
                self._inner = real(path, **kwargs)

            def __enter__(self) -> Handle:
                self._inner.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                self._inner.__exit__(*exc)

            def keys(self) -> list[str]:
                return list(self._inner.keys())

            def get_tensor(self, key: str) -> torch.Tensor:
                counter.read.append(key)
                return self._inner.get_tensor(key)

        monkeypatch.setattr(safetensors, "safe_open", Handle)


# --- weights ------------------------------------------------------------------------------


def test_a_stage_reads_only_its_own_tensors(
    gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = _ReadCounter(monkeypatch)
    CausalLmStage.build(causal_lm_spec(gpt2_dir), 1, 3)  # blocks 0 and 1
    assert counter.read, "nothing was read"
    assert all(key.startswith(("transformer.h.0.", "transformer.h.1.")) for key in counter.read)
    assert len(counter.read) == len(set(counter.read)) == 2 * 12  # 12 tensors a GPT-2 block


def test_a_sharded_checkpoint_opens_only_the_shards_a_stage_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = hf_model("llama")
    directory = write_checkpoint(model, tmp_path, max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").is_file()
    spec = causal_lm_spec(directory)
    counter = _ReadCounter(monkeypatch)
    stage = CausalLmStage.build(spec, 4, 5)  # the head only
    assert sorted(counter.read) == ["lm_head.weight", "model.norm.weight"]
    assert len(set(counter.opened)) < len(set(_shards(directory)))
    torch.testing.assert_close(stage.units[0].lm_head.weight, model.lm_head.weight)


def _shards(directory: Path) -> list[str]:
    return [p.name for p in directory.glob("model-*.safetensors")]


def test_a_checkpoint_that_lacks_a_units_tensor_is_refused(tmp_path: Path) -> None:
    model = hf_model("llama")
    directory = write_checkpoint(model, tmp_path)
    state = {k: v for k, v in model.state_dict().items() if "layers.1.mlp" not in k}
    safetensors.torch.save_file(state, str(directory / "model.safetensors"))
    spec = causal_lm_spec(directory)
    CausalLmStage.build(spec, 0, 2)  # block 0 is all there
    with pytest.raises(ModelSpecError, match=r"model.layers.1.mlp.* for unit 2"):
        CausalLmStage.build(spec, 2, 3)


def test_a_directory_without_safetensors_is_refused(tmp_path: Path) -> None:
    model = hf_model("gpt2")
    model.config.to_json_file(str(tmp_path / "config.json"))
    with pytest.raises(ModelSpecError, match=r"neither model\.safetensors"):
        CausalLmStage.build(causal_lm_spec(tmp_path), 0, 1)


# --- tied weights -------------------------------------------------------------------------


def test_a_tied_head_on_its_own_stage_holds_a_copy_of_the_embedding(gpt2_dir: Path) -> None:
    first, *_, last = build_stages(gpt2_dir, SPLITS[3])
    embedding, head = first.units[0].wte.weight, last.units[-1].lm_head.weight
    torch.testing.assert_close(head, embedding, rtol=0, atol=0)
    assert head.data_ptr() != embedding.data_ptr()
    (whole,) = build_stages(gpt2_dir, SPLITS[1])
    assert whole.units[-1].lm_head.weight is whole.units[0].wte.weight  # one copy on one stage


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_seeded_random_units_are_the_same_whichever_stage_builds_them(preset: str) -> None:
    spec = ModelSpec.preset(preset, seed=5, tie_word_embeddings=True)
    sequence = load_layer_sequence(spec)
    full = build_full_model(spec).state_dict()
    n = sequence.num_units
    for start, end in [(0, 1), (1, n - 1), (n - 1, n)]:
        for offset, unit in enumerate(sequence.build_units(start, end)):
            for name, tensor in unit.state_dict().items():
                torch.testing.assert_close(tensor, full[f"units.{start + offset}.{name}"])
    head = sequence.build_units(n - 1, n)[0]
    torch.testing.assert_close(head.lm_head.weight, full["units.0." + _token_key(preset)])
    other = load_layer_sequence(ModelSpec.preset(preset, seed=6)).build_units(0, 1)[0]
    assert not torch.equal(
        other.state_dict()[_token_key(preset)], full["units.0." + _token_key(preset)]
    )


def _token_key(preset: str) -> str:
    return "wte.weight" if preset.startswith("gpt2") else "embed_tokens.weight"


def test_a_random_model_runs_the_same_split_or_whole() -> None:
    spec = ModelSpec.preset("llama-tiny", seed=2)
    whole = [CausalLmStage.build(spec, 0, 4)]
    split = [CausalLmStage.build(spec, 0, 2), CausalLmStage.build(spec, 2, 4)]
    prompt = torch.tensor([3, 1, 4, 1, 5])
    outs = []
    for stages in (whole, split):
        for stage in stages:
            stage.open_sequence(0, 5)
        outs.append(chain_forward(stages, [SequenceChunk(0, 0, 5)], prompt, all_logits=True))
    torch.testing.assert_close(outs[0], outs[1])
    # the stateless forward of the family (every unit, nothing cached) agrees too
    (stateless,) = build_full_model(spec)(prompt[None])
    torch.testing.assert_close(outs[0], stateless[0])


# --- the KV cache -------------------------------------------------------------------------


def test_bytes_per_token_from_the_config_are_what_the_cache_allocates() -> None:
    spec = ModelSpec.preset("llama-tiny")
    config = read_causal_lm_config(spec.config)
    per_block = kv_bytes_per_token_per_block(config)
    assert per_block == 2 * 2 * 8 * 4  # K and V, 2 kv heads of 8, float32
    stage = CausalLmStage.build(spec, 0, 3)  # the embedding and 2 blocks
    assert stage.cache.bytes_per_token == 2 * per_block
    assert load_layer_sequence(spec).kv_bytes_per_token(0, 3) == 2 * per_block  # type: ignore[attr-defined]
    stage.open_sequence(1, 32)
    chain_forward([stage], [SequenceChunk(1, 0, 32)], torch.zeros(32, dtype=torch.int64))
    assert stage.cache.allocated_bytes() == 32 * stage.cache.bytes_per_token


def test_a_sequence_over_the_budget_is_refused_and_nothing_changes() -> None:
    spec = ModelSpec.preset("gpt2-tiny")
    probe = CausalLmStage.build(spec, 1, 3)
    per_token = probe.cache.bytes_per_token
    stage = CausalLmStage.build(spec, 1, 3, kv_budget_bytes=50 * per_token)
    stage.open_sequence(1, 30)
    with pytest.raises(KvCacheFullError, match="free") as caught:
        stage.open_sequence(2, 21)
    assert caught.value.sequence_id == 2
    assert caught.value.needed_bytes == 21 * per_token
    assert caught.value.free_bytes == 20 * per_token
    assert 2 not in stage.cache and stage.cache.reserved_bytes == 30 * per_token
    stage.open_sequence(2, 20)  # exactly what is left
    assert stage.free_sequence(1)
    stage.open_sequence(3, 30)  # freeing gave its room back
    assert not stage.free_sequence(1)  # already gone
    assert stage.free_all() == 2 and stage.cache.reserved_bytes == 0
    stage.open_sequence(4, 50)


def test_a_sequence_longer_than_the_context_is_refused() -> None:
    stage = CausalLmStage.build(ModelSpec.preset("gpt2-tiny"), 0, 2, max_context=16)
    with pytest.raises(KvCacheFullError, match="context of 16 tokens"):
        stage.open_sequence(1, 17)
    with pytest.raises(ConfigError, match="max_context"):
        CausalLmStage.build(ModelSpec.preset("gpt2-tiny"), 0, 2, max_context=65)


def test_steps_that_do_not_continue_the_cache_are_refused_before_compute() -> None:
    stage = CausalLmStage.build(ModelSpec.preset("llama-tiny"), 0, 2)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(SequenceStateError, match="no KV cache"):
        stage.forward([SequenceChunk(9, 0, 3)], ids)
    stage.open_sequence(9, 4)
    with pytest.raises(SequenceStateError, match="starts at position 1"):
        stage.forward([SequenceChunk(9, 1, 3)], ids)
    stage.forward([SequenceChunk(9, 0, 3)], ids)
    with pytest.raises(SequenceStateError, match="exceed the 4 reserved"):
        stage.forward([SequenceChunk(9, 3, 2)], ids[:2])
    with pytest.raises(ConfigError, match="token ids"):
        stage.forward([SequenceChunk(9, 3, 1)], ids)  # 3 ids for a 1-token chunk
    assert stage.cached_tokens(9) == 3  # the refused steps wrote nothing
    stage.forward([SequenceChunk(9, 3, 1)], ids[:1])
    assert stage.free_sequence(9)
    with pytest.raises(SequenceStateError, match="no KV cache"):
        stage.forward([SequenceChunk(9, 4, 1)], ids[:1])


def test_a_bfloat16_stage_keeps_a_bfloat16_cache() -> None:
    spec = ModelSpec.preset("llama-tiny")
    stage = CausalLmStage.build(spec, 0, 4, dtype=torch.bfloat16)
    assert stage.cache.bytes_per_token == 2 * kv_bytes_per_token_per_block(
        read_causal_lm_config(spec.config), element_bytes=2
    )
    stage.open_sequence(1, 6)
    logits = stage.forward([SequenceChunk(1, 0, 5)], torch.tensor([3, 1, 4, 1, 5]))
    assert logits.dtype == torch.bfloat16 and logits.shape == (1, 100)


def test_hidden_states_of_the_wrong_width_are_refused() -> None:
    stage = CausalLmStage.build(ModelSpec.preset("llama-tiny"), 1, 4)
    stage.open_sequence(1, 8)
    with pytest.raises(ConfigError, match=r"hidden states \[2, 32\]"):
        stage.forward([SequenceChunk(1, 0, 2)], torch.zeros(2, 31))


def test_a_preset_overrides_keys_and_a_bad_config_is_refused() -> None:
    assert load_layer_sequence(ModelSpec.preset("gpt2-tiny", n_layer=5)).num_units == 7
    with pytest.raises(ModelSpecError, match="model_type"):
        load_layer_sequence(ModelSpec("causal_lm", {"model_type": "t5"}))
    with pytest.raises(ModelSpecError, match="num_key_value_heads"):
        ModelSpec.preset("llama-tiny", num_key_value_heads=3)


def test_zpipes_own_weights_file_loads_a_tied_head_on_its_own_stage(tmp_path: Path) -> None:
    trained = ModelSpec.preset("gpt2-tiny", seed=11)
    path = tmp_path / "w.safetensors"
    save_weights(build_full_model(trained), path)
    spec = ModelSpec.preset("gpt2-tiny", seed=0, weights=str(path))  # the seed no longer counts
    head = CausalLmStage.build(spec, 3, 4).units[0]
    torch.testing.assert_close(
        head.lm_head.weight, build_full_model(trained).units[0].wte.weight, rtol=0, atol=0
    )


def test_a_peers_huge_causal_lm_is_refused_before_anything_is_built() -> None:
    huge = {**ModelSpec.preset("llama-tiny").config, "hidden_size": 2**20, "vocab_size": 2**20}
    spec = ModelSpec.from_dict({"family": "causal_lm", "config": huge})
    with pytest.raises(ModelSpecError, match="more than"):
        count_units(spec)
