"""Synthetic pairs of the Qwen3, OLMo 2 and Phi-3 shapes (runtime.models.loading.synthetic,
synthetic_shapes): a recipe loads the very model its materialized files hold, transformers
reads those files as its own family and agrees with our model, the draft (the target's first
K layers) agrees with the target the more the smaller eps is, and the 8b-class shapes count
the real models' parameters."""

from __future__ import annotations

import json
import math

import pytest
import torch

from runtime.models import LlamaForCausalLM, load_model
from runtime.models.loading.loader import open_weights
from runtime.models.loading.synthetic import build_pair, tensor_plan
from runtime.models.loading.synthetic_shapes import SHAPES
from runtime.models.loading.weights import SafetensorsWeights
from tests.model_helpers import extend, hf_logits

pytestmark = pytest.mark.timeout(240)

F32, CPU = torch.float32, torch.device("cpu")
TINY = ("qwen3-tiny", "olmo2-tiny", "phi3-tiny")
HF_CLASS = {"qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM"}
SEQ = torch.randint(0, 256, (96,), generator=torch.Generator().manual_seed(0)).tolist()


def _ours(path: str) -> LlamaForCausalLM:
    model = load_model(path, F32, CPU)
    assert isinstance(model, LlamaForCausalLM)
    model.allocate_cache(2, 128)
    return model


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, dict[str, tuple[str, str]]]:
    """shape -> {"files": (draft, target), "recipe": (draft, target)}, eps 0.1."""
    root = tmp_path_factory.mktemp("synthetic_families")
    return {
        shape: {
            form: build_pair(root / shape / form, shape, 2, eps=0.1, materialize=form == "files")
            for form in ("files", "recipe")
        }
        for shape in TINY
    }


@pytest.mark.parametrize("shape", TINY)
def test_recipe_and_files_hold_the_same_model(pairs, shape):
    for role in (0, 1):  # draft, target
        files, recipe = pairs[shape]["files"][role], pairs[shape]["recipe"][role]
        raw = SafetensorsWeights(files)
        assert raw.names() == open_weights(recipe).names()  # Phi-3's fused, as written
        got, want = extend(_ours(recipe), 0, 0, SEQ), extend(_ours(files), 0, 0, SEQ)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("shape", TINY)
def test_transformers_reads_the_files_as_the_family_and_agrees(pairs, shape):
    import transformers

    target = pairs[shape]["files"][1]
    config = json.loads(open(f"{target}/config.json").read())
    family = SHAPES[shape]["family"]
    assert config["model_type"] == family and config["architectures"] == [HF_CLASS[family]]
    ref = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=F32).eval()
    assert type(ref).__name__ == HF_CLASS[family]
    with torch.no_grad():
        want = hf_logits(ref, SEQ)
    torch.testing.assert_close(extend(_ours(target), 0, 0, SEQ), want, atol=1e-4, rtol=0)


def test_family_tensors(pairs):
    """Qwen3's per-head q/k norms, OLMo 2's whole-projection q/k norms and post-norms (its
    eps on the post-norms of layers from K on), Phi-3's fused projections."""
    qwen = SafetensorsWeights(pairs["qwen3-tiny"]["files"][1])
    assert qwen.get("model.layers.0.self_attn.q_norm.weight").shape == (32,)
    olmo = SafetensorsWeights(pairs["olmo2-tiny"]["files"][1])
    assert olmo.get("model.layers.0.self_attn.k_norm.weight").shape == (2 * 16,)
    assert "model.layers.0.input_layernorm.weight" not in olmo.names()
    for layer, value in ((1, 1.0), (2, 0.1)):
        for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):
            weight = olmo.get(f"model.layers.{layer}.{norm}.weight")
            assert torch.allclose(weight, torch.full_like(weight, value))
    assert olmo.get("model.layers.3.mlp.down_proj.weight").std() > 0.015  # not scaled
    phi = SafetensorsWeights(pairs["phi3-tiny"]["files"][1])
    assert phi.get("model.layers.0.self_attn.qkv_proj.weight").shape == (3 * 64, 64)
    assert phi.get("model.layers.0.mlp.gate_up_proj.weight").shape == (2 * 128, 64)
    assert "model.layers.0.self_attn.q_proj.weight" not in phi.names()


def test_phi3_recipe_reads_the_parts_of_its_fused_rows(pairs):
    """A Phi-3 recipe opened for the model lists q/k/v and gate/up as the files do, and a
    tensor-parallel slice of a part is those rows of the fused tensor."""
    files, recipe = pairs["phi3-tiny"]["files"][1], pairs["phi3-tiny"]["recipe"][1]
    model = load_model(files, F32, CPU)
    a, b = open_weights(files, model), open_weights(recipe, model)
    assert a.names() == b.names() and "model.layers.3.self_attn.v_proj.weight" in b.names()
    for name in ("model.layers.3.self_attn.k_proj.weight", "model.layers.3.mlp.up_proj.weight"):
        assert torch.equal(a.get(name), b.get(name))
        assert torch.equal(b.get_shard(name, 0, 16, 48), a.get(name)[16:48])


def _agreement(tmp_path, shape: str, eps: float) -> float:
    draft, target = build_pair(tmp_path / f"{shape}-{eps}", shape, 2, eps=eps, materialize=False)
    a, b = (extend(_ours(p), 0, 0, SEQ).argmax(-1) for p in (draft, target))
    return (a == b).float().mean().item()


@pytest.mark.parametrize("shape", TINY)
def test_draft_agrees_with_the_target_as_eps_says(tmp_path, shape):
    """Greedy (teacher-forced) agreement of the 2-layer draft with the 4-layer target."""
    assert _agreement(tmp_path, shape, 0.0) == 1.0
    small, large = _agreement(tmp_path, shape, 0.02), _agreement(tmp_path, shape, 1.0)
    assert small >= 0.9 and large <= 0.5, (small, large)


@pytest.mark.parametrize(
    "shape, billions", [("qwen3-8b", 8.19), ("olmo2-7b", 7.30), ("phi3-mini", 3.82)]
)
def test_8b_class_shapes_count_the_real_models_parameters(shape, billions):
    plan = tensor_plan(shape, "target", 2, 0.02)
    assert sum(math.prod(s) for s, _ in plan.values()) / 1e9 == pytest.approx(billions, abs=0.01)
