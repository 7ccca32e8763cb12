"""The shapes of the synthetic pairs (runtime.models.loading.synthetic), without torch, so the
command lines' --synthetic choices read SHAPES too: each shape's config numbers and family,
the config.json of a draft or target, every layer tensor's shape, and the tensors the eps
scheme scales.

Families (as the real models, 8b-class, plus a tiny variant of each for CPU tests):
- llama (tiny .. 70b): Llama 3's layout.
- qwen3: Qwen3-8B's shape; q/k RMSNorm per head before RoPE (weight [head_dim]).
- olmo2: OLMo-2-1124-7B's; q/k RMSNorm over the whole projection ([H*D], [Hkv*D]) and
  post-norms (x + norm(attn(x)), then + norm(mlp(.)); no input norm).
- phi3: Phi-3-mini's (3.8B); fused self_attn.qkv_proj and mlp.gate_up_proj, written fused as
  in the real checkpoints (transformers reads them so; our loader splits them on load,
  runtime.models.loading.fused_tensors, recipes included). Phi-3-mini-4k's 2047-token
  sliding window is left out: every synthetic pair has a full 8192-token context.

The eps scheme: the target's layers from K on add little to the residual stream, so its
first K layers (the draft) agree with it more the smaller eps is. For the pre-norm families
their o_proj and down_proj weights are scaled by eps (what they add is linear in them). An
OLMo 2 layer norms those outputs before adding them, which undoes any scale of o_proj or
down_proj; there the layer's two post-norm weights (post_attention_layernorm,
post_feedforward_layernorm) are eps instead of 1, so what it adds has RMS eps. Every other
norm weight, q/k norms included, is 1: a norm then only normalizes, the same in draft and
target.
"""

from __future__ import annotations

from typing import Any

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)

# shape -> its family and config.json numbers (JSON values: a str family, int sizes)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(family="llama", **_TINY),
    # CPU-sized: one thread runs a forward in tens of ms, and its 2-layer draft costs about
    # 0.3 of it (the overlap benchmark on two CPU slots)
    "small": dict(
        family="llama",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=4096,
    ),
    "1b": dict(
        family="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
    "8b": dict(
        family="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "70b": dict(
        family="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "qwen3-8b": dict(
        family="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "olmo2-7b": dict(
        family="olmo2",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=100352,
    ),
    "phi3-mini": dict(
        family="phi3",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32064,
    ),
    # head_dim 32 with 4 heads: q is wider than hidden (a head_dim apart from hidden / heads)
    "qwen3-tiny": dict(_TINY, family="qwen3", head_dim=32),
    "olmo2-tiny": dict(_TINY, family="olmo2"),
    "phi3-tiny": dict(_TINY, family="phi3", num_key_value_heads=4),
}

# family -> (architecture, config entries beyond the shape's numbers); the RoPE base and
# norm epsilon are the real models'
FAMILY_CONFIG: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaForCausalLM",
        {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "mlp_bias": False},
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        {
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "sliding_window": None,
        },
    ),
    "olmo2": ("Olmo2ForCausalLM", {"rms_norm_eps": 1e-6, "rope_theta": 500000.0}),
    "phi3": (
        "Phi3ForCausalLM",
        {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": None},
    ),
}

# the tensors of a layer from K on scaled by eps (see the module docstring)
EPS_SCALED = {
    "llama": ("self_attn.o_proj.weight", "mlp.down_proj.weight"),
    "qwen3": ("self_attn.o_proj.weight", "mlp.down_proj.weight"),
    "phi3": ("self_attn.o_proj.weight", "mlp.down_proj.weight"),
    "olmo2": ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
}

CONTEXT = 8192  # max_position_embeddings of every synthetic pair


def config(shape: str, layers: int) -> dict:
    """config.json of `shape` with `layers` layers (torch_dtype bfloat16 until told)."""
    s = dict(SHAPES[shape])
    family = s.pop("family")
    architecture, extra = FAMILY_CONFIG[family]
    return {
        "architectures": [architecture],
        "model_type": family,
        **s,
        "num_hidden_layers": layers,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT,
        **extra,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
    }


def layer_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    """Name (under model.layers.N.) -> shape of every tensor of one layer of `shape`."""
    s = SHAPES[shape]
    family, h, i = s["family"], s["hidden_size"], s["intermediate_size"]
    d = s.get("head_dim") or h // s["num_attention_heads"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    out = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if family == "qwen3":
        out.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    elif family == "olmo2":
        del out["input_layernorm.weight"]
        out.update(
            {
                "self_attn.q_norm.weight": (q,),
                "self_attn.k_norm.weight": (kv,),
                "post_feedforward_layernorm.weight": (h,),
            }
        )
    elif family == "phi3":
        for fused, parts in (
            ("self_attn.qkv_proj.weight", ("q", "k", "v")),
            ("mlp.gate_up_proj.weight", ("gate", "up")),
        ):
            names = [f"{fused.split('.')[0]}.{p}_proj.weight" for p in parts]
            out[fused] = (sum(out.pop(n)[0] for n in names), h)
    return out


def eps_scaled(shape: str) -> tuple[str, ...]:
    """The layer tensors scaled by eps from layer K on."""
    return EPS_SCALED[SHAPES[shape]["family"]]
