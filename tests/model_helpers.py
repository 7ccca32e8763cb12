"""Helpers for tests/unit/models/test_models.py: extra tiny checkpoints and forward_extend
drivers."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.checkpoints import TINY_VOCAB, build_checkpoint


def build_sharded_checkpoint(
    out_dir, arch: str = "llama", seed: int = 0, max_shard_size: str = "60KB", **overrides
) -> str:
    """A tiny checkpoint saved in several safetensors shards with model.safetensors.index.json."""
    import transformers

    out_dir = Path(out_dir)
    single = build_checkpoint(out_dir / "single", arch=arch, seed=seed, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    model.save_pretrained(out_dir / "sharded", max_shard_size=max_shard_size)
    return str(out_dir / "sharded")


def build_fallback_checkpoint(out_dir, arch: str = "gpt2", seed: int = 0) -> str:
    """A tiny non-Llama checkpoint ('gpt2' or 'opt') for the transformers fallback."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.2, **common
        )
    elif arch == "opt":
        config = transformers.OPTConfig(
            hidden_size=64,
            num_hidden_layers=2,
            ffn_dim=128,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            init_std=0.2,
            **common,
        )
    else:
        raise ValueError(f"unknown fallback arch {arch!r}")
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    return str(out_dir)


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [T, V] of a transformers model."""
    return model(torch.tensor([ids])).logits[0].float()


def extend(model, slot: int, start: int, ids: list[int]) -> torch.Tensor:
    """forward_extend of one row; logits [len(ids), V]."""
    out = model.forward_extend(
        torch.tensor([ids]), torch.tensor([slot]), torch.tensor([start]), torch.tensor([len(ids)])
    )
    return out[0].float()


def extend_ragged(
    model, rows: list[tuple[int, int, list[int]]], pad: int = -1
) -> list[torch.Tensor]:
    """One forward_extend over rows (slot, start, ids), right-padded with `pad`;
    returns each row's valid logits [len(ids), V]."""
    width = max(len(ids) for _, _, ids in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for b, (_, _, ids) in enumerate(rows):
        input_ids[b, : len(ids)] = torch.tensor(ids)
    out = model.forward_extend(
        input_ids,
        torch.tensor([r[0] for r in rows]),
        torch.tensor([r[1] for r in rows]),
        torch.tensor([len(r[2]) for r in rows]),
    )
    return [out[b, : len(ids)].float() for b, (_, _, ids) in enumerate(rows)]


def greedy(
    model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None, slot: int = 0
) -> list[int]:
    """Greedy decoding with forward_extend: prefill, then one token per call; stops after EOS."""
    logits = extend(model, slot, 0, prompt)
    out: list[int] = []
    while True:
        token = int(logits[-1].argmax())
        out.append(token)
        if token == eos_token_id or len(out) == max_new_tokens:
            return out
        logits = extend(model, slot, len(prompt) + len(out) - 1, [token])
