"""Synthetic draft/target pairs with random weights, for benchmarks and GPU checks.

Target: a Llama-shaped model (normal weights, std 0.02, seed 0). Draft: the target's first K
layers sharing its embeddings, final norm and LM head. The target's layers from K on have
o_proj and down_proj scaled by eps, so the draft's agreement with the target falls as eps
grows. Every FLOP is real; acceptance is measured, never assumed.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
}


def _config(shape: dict, layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            **shape, "num_hidden_layers": layers, "hidden_act": "silu",
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
            "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16"}


def _layer_shapes(s: dict) -> dict[str, tuple[int, ...]]:
    h, i = s["hidden_size"], s["intermediate_size"]
    d = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * d
    return {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,)}


def _tensor(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def build_pair(out_dir: str | Path, shape: str = "tiny", draft_layers: int = 2,
               eps: float = 0.0, seed: int = 0, dtype: torch.dtype = torch.float32
               ) -> tuple[str, str]:
    """Write draft/ and target/ checkpoints under out_dir; returns their paths."""
    s = SHAPES[shape]
    if not 1 <= draft_layers <= s["num_hidden_layers"]:
        raise ValueError(f"draft_layers must be in 1..{s['num_hidden_layers']}")
    out = Path(out_dir)
    gen = torch.Generator().manual_seed(seed)
    shared = {"model.embed_tokens.weight": _tensor((s["vocab_size"], s["hidden_size"]), gen,
                                                   dtype),
              "model.norm.weight": torch.ones(s["hidden_size"], dtype=dtype),
              "lm_head.weight": _tensor((s["vocab_size"], s["hidden_size"]), gen, dtype)}
    draft, target = dict(shared), dict(shared)
    for layer in range(s["num_hidden_layers"]):
        for name, shp in _layer_shapes(s).items():
            t = _tensor(shp, gen, dtype)
            key = f"model.layers.{layer}.{name}"
            if layer < draft_layers:
                draft[key] = t
            elif name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                t = t * eps
            target[key] = t
    paths = []
    for name, tensors, layers in (("draft", draft, draft_layers),
                                  ("target", target, s["num_hidden_layers"])):
        path = out / name
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(_config(s, layers), indent=1))
        paths.append(str(path))
    return paths[0], paths[1]
