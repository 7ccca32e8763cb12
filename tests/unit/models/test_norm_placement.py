"""A family's norms as data: model_args.NormPlacement chosen per model_type (NORM_PLACEMENT),
Gemma's other traits as fields of their own, and the decoder layer built and run by them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from runtime.models.arch.base import is_paged
from runtime.models.arch.llama import LlamaForCausalLM
from runtime.models.arch.model_args import ModelArgs, NormPlacement
from runtime.models.arch.norms import GemmaRMSNorm, RMSNorm

pytestmark = pytest.mark.timeout(60)

SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=96,
    max_position_embeddings=128,
)
PRE, POST, SANDWICH = NormPlacement.PRE, NormPlacement.POST, NormPlacement.SANDWICH
# config class -> (placement, unit-offset norms and scaled embeddings: Gemma's other traits)
FAMILIES = {
    "LlamaConfig": (PRE, False),
    "MistralConfig": (PRE, False),
    "Qwen2Config": (PRE, False),
    "Qwen3Config": (PRE, False),
    "Phi3Config": (PRE, False),
    "Olmo2Config": (POST, False),
    "Gemma2Config": (SANDWICH, True),
    "Gemma3TextConfig": (SANDWICH, True),
}
NORMS = {
    PRE: {"input_layernorm", "post_attention_layernorm"},
    POST: {"post_attention_layernorm", "post_feedforward_layernorm"},
    SANDWICH: {
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    },
}


def _args(config_class: str) -> ModelArgs:
    return ModelArgs.from_hf_config(getattr(transformers, config_class)(**SIZES))


def _layer_norms(model: LlamaForCausalLM) -> dict[str, type]:
    layer = model.model.layers[0]
    return {
        name: type(module) for name, module in layer.named_children() if isinstance(module, RMSNorm)
    }


@pytest.mark.parametrize("config_class", list(FAMILIES))
def test_each_family_places_its_norms_as_data(config_class):
    placement, gemma = FAMILIES[config_class]
    args = _args(config_class)
    assert args.norm_placement is placement
    assert args.unit_offset_norms == args.scale_embeddings == gemma
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    assert is_paged(model)
    norms = _layer_norms(model)
    assert set(norms) == NORMS[placement] and model.model.layers[0].norms is placement
    assert set(norms.values()) == {GemmaRMSNorm if gemma else RMSNorm}
    assert (model.model.embed_scale is not None) == gemma


@pytest.mark.parametrize("placement", list(NormPlacement))
def test_a_placement_needs_no_other_trait(placement):
    """The placement is one field among Gemma's traits: Llama's layout with any placement
    builds plain RMSNorms where it says and runs (a future family is one table entry)."""
    args = dataclasses.replace(_args("LlamaConfig"), norm_placement=placement)
    model = LlamaForCausalLM(args)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    norms = _layer_norms(model)
    assert set(norms) == NORMS[placement] and set(norms.values()) == {RMSNorm}
    model.allocate_cache(2, 32)
    ids = torch.randint(0, 96, (2, 5))
    logits = model.forward_extend(ids, torch.tensor([0, 1]), torch.zeros(2), torch.tensor([5, 3]))
    assert logits.shape == (2, 5, 96) and logits[0].isfinite().all()
