"""Checkpoint interop: foreign and plain state dicts, importers, optimizer state, resume.

Hugging Face models are built here with random weights from tiny configs
(nothing is downloaded); timm is not installed, so its key layout is made from
the HF model's tensors. The multi-process tests use the shared local cluster.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from zpipe._errors import ConfigError, ModelSpecError
from zpipe.cli.import_checkpoint import main as import_main
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence, run_units
from zpipe.models import weights as weights_module
from zpipe.models.examples import tiny_residual, tiny_sequential
from zpipe.models.importers import import_checkpoint
from zpipe.models.weights import STEPS_KEY, unit_key
from zpipe.stage.executors.training_shard import TrainShard

transformers = pytest.importorskip("transformers")

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY["intermediate_size"] = 64


def vit_config(**extra: Any) -> Any:
    return transformers.ViTConfig(**TINY, image_size=32, patch_size=8, **extra)


def bert_config(**extra: Any) -> Any:
    return transformers.BertConfig(**TINY, vocab_size=100, max_position_embeddings=16, **extra)


def max_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape
    return float((got - want).abs().max())


def imported_model(kind: str, hf: nn.Module, config: Any) -> tuple[nn.Module, ModelSpec]:
    imported = import_checkpoint(kind, hf.state_dict(), config=config.to_dict())
    spec = imported.spec()
    model = build_full_model(spec)
    model.load_state_dict(imported.state)
    return model.eval(), spec


# ------------------------------------------------------------------ importers


@pytest.mark.parametrize("with_classifier", [False, True], ids=["ViTModel", "classifier"])
def test_hf_vit_maps_exactly(with_classifier: bool) -> None:
    torch.manual_seed(0)
    if with_classifier:
        hf = transformers.ViTForImageClassification(vit_config(num_labels=5)).eval()
    else:
        hf = transformers.ViTModel(vit_config()).eval()
    model, spec = imported_model("hf-vit", hf, hf.config)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        out = hf(pixel_values=images)
        want = out.logits if with_classifier else out.last_hidden_state[:, 0]
        got = model(images)[0]
    assert spec.config["num_classes"] == (5 if with_classifier else 0)
    assert max_difference(got, want) <= 1e-6


def timm_layout(hf_vit: nn.Module) -> dict[str, torch.Tensor]:
    """A timm VisionTransformer's state dict, made from an HF ViT's tensors."""
    hf = {k.removeprefix("vit."): v for k, v in hf_vit.state_dict().items()}
    layers = "layers" if any(k.startswith("layers.") for k in hf) else "encoder.layer"
    modern = layers == "layers"
    state = {
        "cls_token": hf["embeddings.cls_token"],
        "pos_embed": hf["embeddings.position_embeddings"],
        "patch_embed.proj.weight": hf["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": hf["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": hf["layernorm.weight"],
        "norm.bias": hf["layernorm.bias"],
        "head.weight": hf["classifier.weight"],
        "head.bias": hf["classifier.bias"],
    }
    for block in range(hf_vit.config.num_hidden_layers):
        src = f"{layers}.{block}"
        qkv = ("q_proj", "k_proj", "v_proj") if modern else ("query", "key", "value")
        attention = f"{src}.attention" if modern else f"{src}.attention.attention"
        names = {
            "norm1": "layernorm_before",
            "norm2": "layernorm_after",
            "attn.proj": "attention.o_proj" if modern else "attention.output.dense",
            "mlp.fc1": "mlp.fc1" if modern else "intermediate.dense",
            "mlp.fc2": "mlp.fc2" if modern else "output.dense",
        }
        for leaf in ("weight", "bias"):
            state[f"blocks.{block}.attn.qkv.{leaf}"] = torch.cat(
                [hf[f"{attention}.{part}.{leaf}"] for part in qkv]
            )
            for theirs, hf_name in names.items():
                state[f"blocks.{block}.{theirs}.{leaf}"] = hf[f"{src}.{hf_name}.{leaf}"]
    return state


def test_timm_vit_layout_maps_exactly() -> None:
    torch.manual_seed(1)
    # timm's ViTs use LayerNorm eps 1e-6, which the timm importer assumes
    hf = transformers.ViTForImageClassification(vit_config(num_labels=7, layer_norm_eps=1e-6))
    hf.eval()
    imported = import_checkpoint("timm-vit", timm_layout(hf), heads=4)
    assert imported.dropped == []
    model = build_full_model(imported.spec())
    model.load_state_dict(imported.state)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert max_difference(model.eval()(images)[0], hf(pixel_values=images).logits) <= 1e-6
    # the head count is in no tensor's shape: without it the error says how to give it
    with pytest.raises(ModelSpecError, match="--heads"):
        import_checkpoint("timm-vit", timm_layout(hf))


@pytest.mark.parametrize("with_classifier", [False, True], ids=["BertModel", "classifier"])
def test_hf_bert_maps_onto_post_ln_bert_with_mask_and_token_types(with_classifier: bool) -> None:
    torch.manual_seed(2)
    if with_classifier:
        hf = transformers.BertForSequenceClassification(bert_config(num_labels=3)).eval()
    else:
        hf = transformers.BertModel(bert_config()).eval()
    model, spec = imported_model("hf-bert", hf, hf.config)
    assert spec.config["kind"] == "bert-post"
    ids, mask, types = load_layer_sequence(spec).example_input(4, seed=3)
    assert (mask == 0).any() and (types == 1).any()  # padding and two segments exercised
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        want = out.logits if with_classifier else out.pooler_output
        got = model(ids, mask, types)[0]
        # the mask matters: without it the outputs differ
        unmasked = model(ids, torch.ones_like(mask), types)[0]
    assert max_difference(got, want) <= 1e-5
    assert max_difference(unmasked, want) > 100 * max(max_difference(got, want), 1e-7)


def test_zpipe_import_writes_weights_each_stage_reads_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(3)
    hf = transformers.BertForSequenceClassification(bert_config(num_labels=2)).eval()
    hf.save_pretrained(tmp_path / "hf")  # model.safetensors + config.json
    dest = tmp_path / "bert.safetensors"
    assert import_main(["hf-bert", str(tmp_path / "hf"), str(dest)]) == 0
    spec = ModelSpec.from_dict(json.loads(dest.with_suffix(".spec.json").read_text()))
    sequence = load_layer_sequence(spec)
    read: list[str] = []
    original_get = weights_module._SafetensorsReader.get

    def spy(self: Any, key: str) -> torch.Tensor:
        read.append(key)
        return original_get(self, key)

    monkeypatch.setattr(weights_module._SafetensorsReader, "get", spy)
    cut = 5
    first, second = sequence.build_units(0, cut), sequence.build_units(cut, sequence.num_units)
    second_keys = set(read[len(read) - sum(len(u.state_dict()) for u in second) :])
    assert all(weights_module.split_unit_key(k)[0] >= cut for k in second_keys)  # type: ignore[index]
    assert len(read) == len(set(read))  # every tensor read once, by the stage that owns it
    inputs = sequence.example_input(3, seed=4)
    with torch.no_grad():
        got = run_units(second, run_units(first, inputs))[0]
        want = hf(input_ids=inputs[0], attention_mask=inputs[1], token_type_ids=inputs[2]).logits
    assert max_difference(got, want) <= 1e-5


def test_import_refuses_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    vit = transformers.ViTModel(vit_config())
    with pytest.raises(ModelSpecError, match="embeddings"):
        import_checkpoint("hf-bert", {"foo.weight": torch.zeros(2)})
    with pytest.raises(ModelSpecError, match="word_embeddings"):
        import_checkpoint("hf-bert", vit.state_dict(), config=vit.config.to_dict())
    source = tmp_path / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, str(source))
    assert import_main(["hf-bert", str(source), str(tmp_path / "out.pt"), "--heads", "4"]) == 1


# ------------------------------------------------------------------ plain state dicts


def test_a_plain_sequential_state_dict_loads(tmp_path: Path) -> None:
    torch.manual_seed(7)
    mine = tiny_sequential()  # the user's own module, trained elsewhere say
    path = tmp_path / "mine.pt"
    torch.save(mine.state_dict(), path)  # keys "0.weight", "2.bias", ...
    config = {"factory": "zpipe.models.examples:tiny_sequential", "input_shape": [8]}
    spec = ModelSpec("sequential", config, seed=99, weights=str(path))
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(build_full_model(spec)(x)[0], mine(x), rtol=0, atol=0)


def test_a_built_in_model_loads_an_nn_sequential_of_its_units(tmp_path: Path) -> None:
    source = ModelSpec.preset("bert-post-tiny", seed=4)
    units = load_layer_sequence(source).build_units(0, load_layer_sequence(source).num_units)
    path = tmp_path / "units.safetensors"
    weights_module.save_weights(nn.Sequential(*units), path)  # keys "<i>.<name>"
    loaded = ModelSpec.preset("bert-post-tiny", seed=5, weights=str(path))
    inputs = load_layer_sequence(source).example_input(2, seed=1)
    with torch.no_grad():
        want = build_full_model(source)(*inputs)[0]
        torch.testing.assert_close(build_full_model(loaded)(*inputs)[0], want, rtol=0, atol=0)
        other = build_full_model(ModelSpec.preset("bert-post-tiny", seed=5))(*inputs)[0]
    assert not torch.equal(other, want)


def test_a_traced_model_loads_its_own_modules_state_dict(tmp_path: Path) -> None:
    torch.manual_seed(8)
    mine = tiny_residual().eval()
    path = tmp_path / "traced.safetensors"
    save_file({k: v.contiguous() for k, v in mine.state_dict().items()}, str(path))
    config = {
        "factory": "zpipe.models.examples:tiny_residual",
        "input_shape": [8],
        "microbatch_size": 4,
    }
    spec = ModelSpec("traced", config, seed=123, weights=str(path))
    x = torch.randn(4, 8)
    sequence = load_layer_sequence(spec)
    with torch.no_grad():
        got = run_units(sequence.build_units(2, 4), run_units(sequence.build_units(0, 2), (x,)))
        torch.testing.assert_close(got[0], mine(x), rtol=0, atol=0)


def test_a_foreign_state_dict_is_refused_with_the_importer_named(tmp_path: Path) -> None:
    path = tmp_path / "foreign.pt"
    torch.save({"encoder.layer.0.weight": torch.zeros(3)}, path)
    spec = ModelSpec.preset("mlp-small", weights=str(path))
    with pytest.raises(ModelSpecError, match="zpipe import"):
        build_full_model(spec)


# ------------------------------------------------------------------ optimizer state, resume


MLP = ModelSpec("mlp", {"dims": [12, 24, 24, 4], "activation": "gelu"}, seed=11)
ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.05}
COSINE = {"name": "cosine", "warmup_steps": 2, "total_steps": 6}


def batches_for(count: int, *, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(6, 12, generator=generator), torch.randint(0, 4, (6,), generator=generator))
        for _ in range(count)
    ]


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(want) <= set(got)
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=1e-6, msg=key)


def train_shard(
    spec: ModelSpec, batches: list[Any], *, start_step: int = 0, resume: bool = False
) -> TrainShard:
    shard = TrainShard.build(
        spec, 0, 3, first=True, last=True, loss="cross_entropy", optimizer=ADAMW,
        lr_schedule=COSINE, start_step=start_step, resume_optimizer=resume,
    )  # fmt: skip
    for mb, (x, y) in enumerate(batches):
        shard.forward(mb, (x,), y, int(y.shape[0]))
        shard.backward(mb)
        shard.step()
    return shard


def test_a_checkpoint_with_optimizer_state_resumes_exactly_in_process(tmp_path: Path) -> None:
    batches = batches_for(6, seed=1)
    whole = train_shard(MLP, batches)
    first = train_shard(MLP, batches[:3])
    path = tmp_path / "ckpt.safetensors"
    weights_module.write_state(
        {**first.training_state(), STEPS_KEY: torch.tensor(3)}, path
    )  # what TrainReport.save writes
    resumed_spec = ModelSpec(MLP.family, dict(MLP.config), seed=MLP.seed, weights=str(path))
    resumed = train_shard(resumed_spec, batches[3:], start_step=3, resume=True)
    assert_same_weights(resumed.state_dict(), whole.state_dict())
    # without the optimizer state (fresh moments) the weights go elsewhere
    fresh = train_shard(resumed_spec, batches[3:], start_step=3).state_dict()
    first_weight = next(key for key in fresh if key.startswith(unit_key(0, "")))
    assert not torch.equal(fresh[first_weight], whole.state_dict()[first_weight])


def test_fit_saves_optimizer_state_and_a_resumed_fit_continues_identically(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    batches = batches_for(6, seed=2)
    want = train_shard(MLP, batches).state_dict()
    common: dict[str, Any] = {
        "optimizer": ADAMW,
        "lr_schedule": COSINE,
        "num_microbatches": 2,
        "partition": [[0, 2], [2, 3]],
        "progress": False,
    }
    first = cluster.fit(MLP, batches[:3], optimizer_state=True, **common)
    assert first.optimizer_state  # Adam's moments and steps came back with the weights
    checkpoint = tmp_path / "half.safetensors"
    first.save(checkpoint)
    resumed_spec = ModelSpec(MLP.family, dict(MLP.config), seed=MLP.seed, weights=str(checkpoint))
    second = cluster.fit(resumed_spec, batches[3:], resume_optimizer=True, start_step=3, **common)
    assert_same_weights(second.state_dict, want)


def test_an_imported_bert_runs_through_a_pipeline_with_its_mask(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    torch.manual_seed(5)
    hf = transformers.BertForSequenceClassification(bert_config(num_labels=2)).eval()
    imported = import_checkpoint("hf-bert", hf.state_dict(), config=hf.config.to_dict())
    path = tmp_path / "bert.safetensors"
    weights_module.write_state(imported.state, path)
    spec = imported.spec(weights=str(path))
    inputs = load_layer_sequence(spec).example_input(3, seed=6)
    # the mask and the token types cross both stage boundaries as integer tensors
    outputs, _ = cluster.infer(spec, [inputs], partition=[[0, 3], [3, 7], [7, 10]])
    with torch.no_grad():
        want = hf(input_ids=inputs[0], attention_mask=inputs[1], token_type_ids=inputs[2]).logits
    assert max_difference(outputs[0][0], want) <= 1e-5


def test_resuming_from_weights_without_optimizer_state_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights_only.safetensors"
    weights_module.save_weights(build_full_model(MLP), path)
    spec = ModelSpec(MLP.family, dict(MLP.config), seed=MLP.seed, weights=str(path))
    with pytest.raises(ConfigError, match="optimizer_state=True"):
        train_shard(spec, [], resume=True)


def test_post_ln_bert_trains_split_like_whole_with_its_integer_mask() -> None:
    spec = ModelSpec.preset("bert-post-tiny", seed=1)
    sequence = load_layer_sequence(spec)
    ids, mask, types = sequence.example_input(4, seed=2)
    labels = torch.randint(0, 2, (4,), generator=torch.Generator().manual_seed(0))
    sgd = {"name": "sgd", "lr": 0.1}

    def shard(start: int, end: int) -> TrainShard:
        return TrainShard(
            sequence.build_units(start, end), start=start, first=start == 0,
            last=end == sequence.num_units, loss="cross_entropy", optimizer=sgd,
        )  # fmt: skip

    first, second = shard(0, 5), shard(5, sequence.num_units)
    hidden, _, _ = first.forward(0, (ids, mask, types))
    assert hidden[-1].dtype == torch.int64  # the mask rides along, needing no gradient
    second.forward(0, hidden, labels, 4)
    grads, _ = second.backward(0)
    first.backward(0, grads)
    first.step()
    second.step()
    model = build_full_model(spec).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(model(ids, mask, types)[0], labels).backward()
    optimizer.step()
    assert_same_weights({**first.state_dict(), **second.state_dict()}, model.state_dict())
