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
    return (torch.randn(shape, generator=gen, device=gen.device) * 0.02).to(dtype).cpu()


SHARD_BYTES = 2 << 30   # target checkpoints are written in shards of about this size


class _ShardWriter:
    """Writes tensors into safetensors shards of about `shard_bytes` as they come, so a big
    synthetic model never sits in host memory whole; a single shard is `model.safetensors`,
    several get HF's `model-0000i-of-0000n.safetensors` names and an index json."""

    def __init__(self, path: Path, shard_bytes: int):
        self.path, self.shard_bytes = path, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []   # (temporary file name, tensor names)
        path.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.path / name))
        self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        total = len(self.files)
        if total == 1:
            (self.path / self.files[0][0]).rename(self.path / "model.safetensors")
            return
        weight_map = {}
        for i, (tmp, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            (self.path / tmp).rename(self.path / final)
            weight_map.update(dict.fromkeys(names, final))
        (self.path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def build_pair(out_dir: str | Path, shape: str = "tiny", draft_layers: int = 2,
               eps: float = 0.0, seed: int = 0, dtype: torch.dtype = torch.float32,
               shard_bytes: int = SHARD_BYTES, gen_device: str | torch.device = "cpu"
               ) -> tuple[str, str]:
    """Write draft/ and target/ checkpoints under out_dir; returns their paths.

    Tensors are drawn one at a time (same values for the same seed whatever the sharding) and
    written in shards, so host memory holds about one shard plus the draft at a time; use
    dtype=torch.bfloat16 for the big shapes (8b: 16 GB on disk, 70b: 141 GB).
    gen_device="cuda:0" draws the random numbers on that GPU (the CPU generator is
    single-threaded: about 2 minutes for 8b, 20 for 70b); the values then differ from the
    CPU's for the same seed, but are the same from run to run on the same setup."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if shape not in SHAPES:
        raise ValueError(f"unknown synthetic shape {shape!r}; choose from {', '.join(SHAPES)}")
    s = SHAPES[shape]
    if not 1 <= draft_layers <= s["num_hidden_layers"]:
        raise ValueError(f"draft_layers must be in 1..{s['num_hidden_layers']}")
    out = Path(out_dir)
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    draft = _ShardWriter(out / "draft", shard_bytes)
    target = _ShardWriter(out / "target", shard_bytes)
    shared = {"model.embed_tokens.weight": _tensor((s["vocab_size"], s["hidden_size"]), gen,
                                                   dtype),
              "model.norm.weight": torch.ones(s["hidden_size"], dtype=dtype),
              "lm_head.weight": _tensor((s["vocab_size"], s["hidden_size"]), gen, dtype)}
    for key, t in shared.items():
        draft.add(key, t)
        target.add(key, t)
    del shared
    for layer in range(s["num_hidden_layers"]):
        for name, shp in _layer_shapes(s).items():
            t = _tensor(shp, gen, dtype)
            key = f"model.layers.{layer}.{name}"
            if layer < draft_layers:
                draft.add(key, t)
            elif name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                t = t * eps
            target.add(key, t)
    dtype_name = str(dtype).removeprefix("torch.")
    for writer, layers in ((draft, draft_layers), (target, s["num_hidden_layers"])):
        writer.close()
        config = dict(_config(s, layers), torch_dtype=dtype_name)
        (writer.path / "config.json").write_text(json.dumps(config, indent=1))
    return str(out / "draft"), str(out / "target")
