"""HFFallbackModel: any transformers causal LM behind the CausalLM interface (TP 1 only).

One DynamicCache per slot; before each row runs, its cache is cropped to start_pos (rollback).
Rows run one at a time, so this is for correctness on unsupported architectures, not speed.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from runtime.models.arch.base import CausalLM, check_extend_args

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel


def _dtype_kwarg() -> str:
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


class HFFallbackModel(nn.Module):
    paged: ClassVar[bool] = False  # a cache per slot of its own (CausalLM, not PagedModel)

    def __init__(self, hf_model: PreTrainedModel):
        super().__init__()
        self.hf_model = hf_model.eval()
        out = hf_model.get_output_embeddings()
        self.vocab_size = (
            int(out.weight.shape[0]) if out is not None else hf_model.config.vocab_size
        )
        params = inspect.signature(hf_model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._caches: dict[int, DynamicCache] = {}
        self.num_slots: int | None = None
        self.max_seq_len: int | None = None

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype, device: torch.device | str
    ) -> HFFallbackModel:
        import transformers

        p = Path(path)
        kwargs: dict[str, Any] = {_dtype_kwarg(): dtype}
        if p.is_file():
            kwargs["gguf_file"] = p.name
            p = p.parent
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
        # transformers wraps PreTrainedModel.to (functools.wraps), typed as unbound: no self
        return cls(model.to(device=device, dtype=dtype))  # type: ignore[call-arg]

    def allocate_cache(self, num_slots: int, max_seq_len: int) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(
                f"need num_slots >= 1 and max_seq_len >= 1, got {num_slots}, {max_seq_len}"
            )
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self._caches.clear()

    def free_slot(self, slot: int) -> None:
        self._caches.pop(int(slot), None)

    def _cache_at(self, slot: int, start: int) -> DynamicCache:
        """The slot's DynamicCache holding exactly positions [0, start)."""
        from transformers import DynamicCache

        cache = self._caches.get(slot)
        held = cache.get_seq_length() if cache is not None else 0
        if start > held:
            raise ValueError(f"slot {slot} holds {held} positions; cannot extend at {start}")
        if cache is None or start == 0:
            cache = DynamicCache()
        elif held > start:
            cache.crop(start - held)  # negative: drop that many (transformers 4 and 5)
        self._caches[slot] = cache
        return cache

    @torch.no_grad()
    def forward_extend(
        self,
        input_ids: torch.Tensor,
        slots: torch.Tensor,
        start_pos: torch.Tensor,
        n_valid: torch.Tensor,
    ) -> torch.Tensor:
        """See runtime.models.arch.base.CausalLM.forward_extend. Logits [B, T, V]."""
        slots, start_pos, n_valid = (
            torch.as_tensor(t).to(input_ids.device, torch.long) for t in (slots, start_pos, n_valid)
        )
        check_extend_args(input_ids, slots, start_pos, n_valid, self.num_slots, self.max_seq_len)
        bsz, seq = input_ids.shape
        rows = zip(slots.tolist(), start_pos.tolist(), n_valid.tolist())
        logits = None
        for b, (slot, start, n) in enumerate(rows):
            if n == 0:
                continue
            cache = self._cache_at(slot, start)
            ids = input_ids[b : b + 1, :n]  # [1, n]
            mask = torch.ones(1, start + n, dtype=torch.long, device=ids.device)
            out = self.hf_model(
                input_ids=ids, attention_mask=mask, use_cache=True, **{self._cache_kwarg: cache}
            )
            if logits is None:
                logits = out.logits.new_zeros(bsz, seq, out.logits.shape[-1])  # [B, T, V]
            logits[b, :n] = out.logits[0]
        if logits is None:  # every row empty
            logits = torch.zeros(bsz, seq, self.vocab_size, device=input_ids.device)
        return logits


if TYPE_CHECKING:  # the type checker's proof that the fallback is a CausalLM
    _causal_lm: type[CausalLM] = HFFallbackModel
