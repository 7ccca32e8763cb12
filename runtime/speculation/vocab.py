"""A draft whose embedding is padded differently from the target's over the same tokenizer
(e.g. Qwen2.5-0.5B: 151,936 rows; Qwen2.5-7B: 152,064; both over 151,665 real tokens).

The draft proposes only ids below `propose` (the tokenizer's size, which fits both
embeddings: runtime.config.vocab), so it never proposes a padding row nor an id the target's
embedding lacks. Its sampling distribution q is over those ids, widened with zeros to the
target's vocab_size for `acceptance: logits` (rejection sampling then reproduces the
target's distribution exactly: q is still the distribution the proposal was drawn from).
The target itself decides over its full vocabulary as transformers does, so it may emit a
padding id; ids the draft's embedding lacks are clamped into it where the draft reads them
(they only steer its guesses, never what is emitted).

Every size is known at load time: slicing and padding keep static shapes, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DraftVocab:
    propose: int  # the draft proposes ids < propose (<= embed and <= width)
    width: int  # the target's vocab_size: the width of q
    embed: int  # the draft's own vocab_size (its logits' width, its embedding's rows)

    def __post_init__(self) -> None:
        if not 0 < self.propose <= min(self.width, self.embed):
            raise ValueError(
                f"DraftVocab: propose {self.propose} must be in "
                f"(0, min(width {self.width}, embed {self.embed})]"
            )

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [..., embed] -> [..., propose]: the ids it may propose."""
        return logits[..., : self.propose]

    def widen(self, q: torch.Tensor) -> torch.Tensor:
        """q [..., propose] -> [..., width], zero past `propose` (the target's size)."""
        if self.width == q.shape[-1]:
            return q
        return F.pad(q, (0, self.width - q.shape[-1]))

    def inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids fed to the draft: those its embedding lacks (target padding ids the
        target emitted, prompt ids below the target's vocab_size) clamped to its last row."""
        if self.embed >= self.width:
            return ids
        return ids.clamp(max=self.embed - 1)
