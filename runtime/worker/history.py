"""The tokens the penalties look back on, per slot, on the device: how often each token was
generated (frequency and presence penalties) and which tokens the prompt or the output hold
(repetition penalty). Kept only for slots whose sampling is penalised; the round adds the
tokens it commits (runtime.worker.round), the draft's proposals and a verify window's drafts
join per position (runtime.speculation.processors)."""

from __future__ import annotations

import torch

from runtime.control.commands import Sampling
from runtime.models.runners.hostcopy import to_device


class TokenHistory:
    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots, self.device = num_slots, device
        self.counts: torch.Tensor | None = None  # [num_slots, V] float32 output counts
        self.seen: torch.Tensor | None = None  # [num_slots, V] bool prompt or output
        self.live: set[int] = set()  # slots kept

    def start(self, slot: int, sampling: Sampling, vocab: int) -> None:
        """A sequence (re)starts in `slot`: its prompt and the output it had (a preempted
        sequence's) as its sampling sends them."""
        self.live.discard(slot)
        if not sampling.penalised or vocab <= 0:
            return
        if self.counts is None or self.seen is None:
            self.counts = torch.zeros(self.num_slots, vocab, device=self.device)
            self.seen = torch.zeros(self.num_slots, vocab, dtype=torch.bool, device=self.device)
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        self.live.add(slot)
        self.add([slot] * 2, [sampling.prompt, sampling.output], counted=[False, True])

    def add(
        self, slots: list[int], rows: list[list[int]], counted: list[bool] | None = None
    ) -> None:
        """Tokens committed to these slots (each row's, as output unless counted says not)."""
        if not self.live or self.counts is None or self.seen is None:
            return
        vocab = self.counts.shape[1]
        counted = counted or [True] * len(slots)
        cells = [
            (slot, token, float(c))
            for slot, row, c in zip(slots, rows, counted)
            if slot in self.live
            for token in row
            if 0 <= token < vocab
        ]
        if not cells:
            return
        r, t, c = zip(*cells)
        index = (
            to_device(list(r), torch.long, self.device),
            to_device(list(t), torch.long, self.device),
        )
        self.counts.index_put_(
            index, to_device(list(c), torch.float32, self.device), accumulate=True
        )
        self.seen[index] = True

    def rows(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The slots' (counts, seen) [B, V], None when none of them is kept."""
        if self.counts is None or self.seen is None or not self.live.intersection(slots):
            return None
        index = to_device(slots, torch.long, self.device)
        return self.counts[index], self.seen[index]

    def release(self, slot: int) -> None:
        self.live.discard(slot)
