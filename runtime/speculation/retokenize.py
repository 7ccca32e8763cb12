"""Token ids across two tokenizers, through text (a draft with a different tokenizer:
docs/configuration.md, "A draft with another tokenizer"; cf. transformers' universal assisted
generation, AssistedCandidateGeneratorDifferentTokenizers).

Rank 0 holds both tokenizers. Each round it maps
- the committed sequence (target ids) to the draft's ids: the whole committed text encoded by
  the draft's tokenizer (`draft_history`);
- the draft's k proposals to target ids (`to_target`): decoded in the context of the draft's
  last tokens (so a proposal that continues a word or starts with a space comes out right),
  appended to the text of the target's last committed tokens and encoded by the target's
  tokenizer. The target's committed tokens are fixed: when the encoding re-splits them (the
  proposal merges into the last committed token) nothing is proposed.

None of this decides what is emitted: the target verifies the mapped proposals with
`acceptance: tokens` (its own choice at every position), so a poor mapping only costs
acceptance. `keep_length` says how much of the draft's cache survives a round.
"""

from __future__ import annotations

__all__ = ["TextBridge", "common_prefix", "keep_length"]

WINDOW = 8  # tokens of context a proposal is decoded and re-encoded in


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of a and b."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TextBridge:
    """The target's tokenizer and the draft's (transformers tokenizers: encode / decode)."""

    def __init__(self, target_tokenizer, draft_tokenizer, window: int = WINDOW):
        self.target = target_tokenizer
        self.draft = draft_tokenizer
        self.window = window

    def draft_history(self, target_ids: list[int]) -> list[int]:
        """The draft's ids for a committed sequence of target ids (its whole text)."""
        text = self.target.decode(target_ids, skip_special_tokens=True)
        return list(self.draft.encode(text, add_special_tokens=False))

    def to_target(
        self, target_ids: list[int], draft_ids: list[int], proposals: list[int]
    ) -> list[int]:
        """Target ids for the draft's proposals that follow draft_ids (the draft's ids of
        the committed target_ids); [] when their text merges into the last committed
        target token or is empty."""
        known = [i for i, t in enumerate(proposals) if not 0 <= t < len(self.draft)]
        proposals = proposals[: known[0]] if known else proposals  # past the tokenizer: cut
        context = draft_ids[-self.window :]
        before = self.draft.decode(context, skip_special_tokens=True)
        after = self.draft.decode(context + proposals, skip_special_tokens=True)
        if not after.startswith(before) or len(after) == len(before):
            return []
        tail = target_ids[-self.window :]
        # special tokens kept: the committed tail must encode back to itself
        text = self.target.decode(tail) + after[len(before) :]
        ids = list(self.target.encode(text, add_special_tokens=False))
        if ids[: len(tail)] != tail:
            return []
        return ids[len(tail) :]


def keep_length(new_history: list[int], fed: list[int]) -> int:
    """Of the draft's cache, which holds the KV of `fed`, the positions a new committed
    history keeps: their common prefix, leaving the history's last token to be fed."""
    return min(common_prefix(new_history, fed), len(new_history) - 1)
