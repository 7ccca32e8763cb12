"""ModelArgs: the few numbers our Llama-family model needs, read from a transformers config.

Both config styles are understood: transformers 5 (`rope_parameters`) and transformers 4
(`rope_theta` + `rope_scaling`). The transformers config object itself is kept, because the
non-default RoPE initialisers of transformers (llama3, yarn, linear, ...) take it as input.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "olmo2",
    "phi3",
    "gemma3_text",
    "gemma2",
)

# what a model loses on the transformers fallback (runtime.models.loading.hf_fallback)
FALLBACK_LACKS = (
    "it runs on the slower transformers fallback: no tensor parallelism, paged "
    "KV cache or prefix caching, CUDA graphs or FP8 GEMMs"
)


class NormPlacement(enum.Enum):
    """Where a decoder layer's RMSNorms sit around its attention and MLP blocks
    (decoder_layer.DecoderLayer picks its forward by it)."""

    PRE = "pre"  # Llama, Qwen, Phi: x + attn(input(x)), then + mlp(post_attention(.))
    POST = "post"  # OLMo 2: x + post_attention(attn(x)), then + post_feedforward(mlp(.))
    # Gemma 2 / 3: x + post_attention(attn(input(x))), then
    # + post_feedforward(mlp(pre_feedforward(.))): four norms a layer
    SANDWICH = "sandwich"


# Where a family differs from Llama, as data (ModelArgs.from_hf_config reads them):
# q/k RMSNorm before RoPE, over each head ("head": Qwen3) or the whole projection ("full":
# OLMo 2, its weight [n_heads * head_dim]); families whose q/k/v always carry a bias;
# the norms' placement (NormPlacement; PRE for a family not listed); sliding windows
# configured by use_sliding_window / layer_types.
QK_NORM = {"qwen3": "head", "olmo2": "full", "gemma3_text": "head"}
ALWAYS_QKV_BIAS = ("qwen2",)
NORM_PLACEMENT = {
    "olmo2": NormPlacement.POST,
    "gemma2": NormPlacement.SANDWICH,
    "gemma3_text": NormPlacement.SANDWICH,
}
QWEN_WINDOWS = ("qwen2", "qwen3")
# Gemma 2 / Gemma 3 (text): sandwich norms (NORM_PLACEMENT), RMSNorm scaling by (1 + weight)
# in float32 (UNIT_OFFSET_NORMS), GeGLU (gelu tanh), embeddings times sqrt(hidden_size)
# (SCALED_EMBEDDINGS), attention scale query_pre_attn_scalar ** -0.5, windows by
# layer_types, final logit soft-capping; Gemma 2 also caps the attention logits (Gemma 3's
# transformers code never passes its attn_logit_softcapping to attention), Gemma 3 has one
# RoPE table a layer type (rope_parameters[layer_type]: local base for sliding layers).
GEMMA = ("gemma2", "gemma3_text")
UNIT_OFFSET_NORMS = GEMMA
SCALED_EMBEDDINGS = GEMMA
ATTN_SOFTCAP = ("gemma2",)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

# RoPE types whose transformers implementation changes the frequencies with the sequence length
# at run time; a static table reproduces them only up to `original_max_position_embeddings`.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict:
    """The RoPE parameters of `config` as one flat dict with at least rope_type and rope_theta;
    layer_type: those of that layer type where they are given per type (Gemma 3)."""
    if layer_type is not None:
        params = config.rope_parameters[layer_type]
    else:
        params = getattr(config, "rope_parameters", None)
    if not params:  # transformers 4 style: rope_theta attribute + optional rope_scaling dict
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    if (
        "rope_type" not in params
        and "type" not in params
        and any(isinstance(v, dict) for v in params.values())
    ):
        raise NotImplementedError("per-layer-type rope_parameters are not supported")
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def unsupported_reason(config: Any) -> str | None:
    """Why our implementation cannot run `config` (then the transformers fallback is used)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}; {FALLBACK_LACKS}"
    if activation(config) not in ACTIVATIONS:
        return f"hidden_act {activation(config)!r} (only {tuple(ACTIVATIONS)})"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention (only causal attention)"
    for layer_type in rope_layer_types(config) or (None,):
        try:
            rope = rope_parameters(config, layer_type)
        except NotImplementedError as exc:
            return str(exc)
        if rope["rope_type"] != "default" and rope["rope_type"] not in _rope_init_functions():
            return f"unknown rope_type {rope['rope_type']!r}"
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial not in (None, 1.0):
            return f"partial_rotary_factor {partial} (only 1.0)"
    return None


def activation(config: Any) -> str:
    """The MLP's activation: hidden_activation (Gemma) or hidden_act."""
    if config.model_type in GEMMA:
        return getattr(config, "hidden_activation", None) or config.hidden_act
    return getattr(config, "hidden_act", "silu")


def rope_layer_types(config: Any) -> tuple[str, ...]:
    """The layer types with RoPE tables of their own, sorted ("full_attention",
    "sliding_attention"): Gemma 3's rope_parameters per type; () for one table."""
    params = getattr(config, "rope_parameters", None) or {}
    if config.model_type == "gemma3_text" and all(isinstance(v, dict) for v in params.values()):
        return tuple(sorted(params))
    return ()


def _rope_init_functions() -> dict:
    """transformers' RoPE initialisers (imported only for a config that needs one)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS


def _layer_windows(config: Any, n_layers: int) -> tuple[int | None, ...]:
    """Sliding-window size of each layer (None = full causal attention)."""
    window = getattr(config, "sliding_window", None)
    if config.model_type in QWEN_WINDOWS:
        if not getattr(config, "use_sliding_window", False):
            return (None,) * n_layers
        types = getattr(config, "layer_types", None)
        if types is None:  # transformers 4: layers from max_window_layers on use the window
            start = getattr(config, "max_window_layers", n_layers)
            types = ["sliding_attention" if i >= start else "full" for i in range(n_layers)]
        return tuple(window if t == "sliding_attention" else None for t in types)
    if config.model_type in GEMMA:
        return tuple(window if t == "sliding_attention" else None for t in config.layer_types)
    return (window,) * n_layers


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: str | None = None  # QK_NORM: "head", "full" or None
    norm_placement: NormPlacement = NormPlacement.PRE  # NORM_PLACEMENT
    unit_offset_norms: bool = False  # UNIT_OFFSET_NORMS: (1 + w) norms (norms.GemmaRMSNorm)
    scale_embeddings: bool = False  # SCALED_EMBEDDINGS: embeddings times sqrt(hidden_size)
    activation: str = "silu"  # ACTIVATIONS' values: "silu" or "gelu_tanh"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # ATTN_SOFTCAP: s = c * tanh(s / c) before the mask
    final_softcap: float | None = None  # the LM head's output likewise
    layer_rope: tuple[str, ...] = ()  # per layer: its rope_layer_types entry; () one table
    hf_config: Any = field(default=None, repr=False)  # for transformers' RoPE initialisers

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArgs:
        reason = unsupported_reason(config)
        if reason is not None:
            raise NotImplementedError(f"unsupported config: {reason}")
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        model_type = config.model_type
        always_bias = model_type in ALWAYS_QKV_BIAS
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            n_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=always_bias or attention_bias,  # Qwen2 always has q/k/v bias
            o_bias=attention_bias and not always_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            layer_windows=_layer_windows(config, config.num_hidden_layers),
            qk_norm=QK_NORM.get(model_type),
            norm_placement=NORM_PLACEMENT.get(model_type, NormPlacement.PRE),
            unit_offset_norms=model_type in UNIT_OFFSET_NORMS,
            scale_embeddings=model_type in SCALED_EMBEDDINGS,
            hf_config=config,
            **_gemma_args(config),
        )


def _gemma_args(config: Any) -> dict:
    """ModelArgs fields of the GEMMA families (none for the others)."""
    if config.model_type not in GEMMA:
        return {}
    cap = config.attn_logit_softcapping if config.model_type in ATTN_SOFTCAP else None
    per_type = rope_layer_types(config)
    return dict(
        activation=ACTIVATIONS[activation(config)],
        attn_scale=config.query_pre_attn_scalar**-0.5,
        attn_softcap=cap or None,
        final_softcap=getattr(config, "final_logit_softcapping", None) or None,
        layer_rope=tuple(config.layer_types) if per_type else (),
    )


def check_tp_shape(name: str, n_heads: int, n_kv: int, size: int) -> None:
    """ValueError unless the attention heads of model `name` split over `size` ranks: query
    heads must divide; KV heads must divide or be replicated evenly (size % n_kv == 0)."""
    if n_heads % size:
        raise ValueError(
            f"cannot shard {name} over {size} ranks: num_attention_heads "
            f"{n_heads} is not divisible by the tensor-parallel size {size}"
        )
    if n_kv % size and size % n_kv:
        raise ValueError(
            f"cannot shard {name} over {size} ranks: num_key_value_heads {n_kv} "
            f"is neither divisible by the tensor-parallel size {size} nor a "
            f"divisor of it"
        )
