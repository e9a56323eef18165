"""bench/inference.py's imported section: the Hugging Face ViT it builds, converted by
``python -m zpipe import hf-vit``, computes what transformers computes, split or whole."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

from bench._imported_vit import (
    all_close,
    hf_logits,
    hf_vit_config,
    import_with_cli,
    make_hf_vit,
    max_abs_diff,
    stage_memory_rows,
)
from zpipe.models import build_full_model, load_layer_sequence, run_units
from zpipe.models.presets import PRESETS
from zpipe.planner.plan import plan_even_partition

TOL = 1e-4


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    config = hf_vit_config(PRESETS["vit-tiny"][1])
    hf = make_hf_vit(config, seed=3)
    spec = import_with_cli(hf, tmp_path_factory.mktemp("hf-vit"))
    return config, hf, spec


def test_every_random_init_tensor_is_perturbed(imported) -> None:  # type: ignore[no-untyped-def]
    _, hf, _ = imported
    # transformers starts biases at 0 and LayerNorm weights at 1: a mapping error there
    # would go unseen unless every tensor holds distinct values
    for name, param in hf.named_parameters():
        assert param.flatten().unique().numel() > 1, name


def test_imported_model_split_and_whole_matches_transformers(imported) -> None:  # type: ignore[no-untyped-def]
    config, hf, spec = imported
    sequence = load_layer_sequence(spec)
    batch = sequence.example_input(3, seed=1)
    expected = [hf_logits(hf, batch)]
    with torch.inference_mode():
        whole = [build_full_model(spec)(*batch)]
        cut = sequence.num_units // 2
        middle = run_units(sequence.build_units(0, cut), batch)
        split = [run_units(sequence.build_units(cut, sequence.num_units), middle)]
    assert expected[0][0].shape == (3, config["num_labels"])
    assert all_close(whole, expected, TOL), max_abs_diff(whole, expected)
    assert all_close(split, expected, TOL), max_abs_diff(split, expected)
    # the comparison tells models apart: another seed's transformers model differs
    other = [hf_logits(make_hf_vit(config, seed=4), batch)]
    assert not all_close(whole, other, TOL)


def test_stage_memory_rows_count_the_imported_weights_exactly(imported) -> None:  # type: ignore[no-untyped-def]
    _, _, spec = imported
    sequence = load_layer_sequence(spec)
    plan = plan_even_partition(sequence.num_units, ["a", "b"])
    rows = stage_memory_rows(spec, plan, sequence.example_input(2, seed=0), {})
    assert [row["units"] for row in rows] == [[s.start, s.end] for s in plan.stages]
    stored = sum(t.numel() * t.element_size() for t in load_file(spec.weights).values())
    assert sum(row["weights_mib"] for row in rows) == pytest.approx(stored / 2**20, abs=0.002)
    for row in rows:
        assert row["measured_mib"] > row["weights_mib"]  # the forward allocated something
        assert row["predicted_mib"] > row["weights_mib"]
