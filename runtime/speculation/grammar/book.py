"""Structured outputs on a worker: per slot whose request has a grammar, its matcher
(runtime.speculation.grammar.window.GrammarWindow) at the committed tokens, and the masks a round
needs: a verify window's (position i after the window's first i proposals), a draft step's or
a target-only step's (after the proposals or steps taken so far this round, advanced over and
rolled back at the round's end). The round commits what it committed (runtime.worker.round).

The matchers run on the host while the models run: the shards start the tokens' copy to the
host (`to_host`) before they queue the next forward, and build the masks after queueing it;
the masks go to the device packed and are unpacked there.

Rank 0 checks that a grammar compiles within its bounds (off its serving loop) and sends its
spec, and its compiled form where compiling takes long, with the request's sampling settings;
the vocabulary xgrammar needs comes once, with the first grammar rank 0 sends (every worker
receives every prefill)."""

from __future__ import annotations

import base64
import zlib
from typing import Any

import torch

from runtime.control.commands import Sampling
from runtime.models.runners.hostcopy import HostCopy


class GrammarBook:
    def __init__(self, device: torch.device):
        self.device = device
        self.windows: dict = {}  # slot -> GrammarWindow
        self._loader: Any = None  # GrammarLoader, from the first grammar's vocabulary

    @property
    def active(self) -> bool:
        return bool(self.windows)

    def start(self, slot: int, sampling: Sampling) -> None:
        """A sequence (re)starts in `slot`: its grammar at the output it had."""
        self.windows.pop(slot, None)
        if not sampling.grammar_kind:
            return
        from runtime.speculation.grammar.window import GrammarWindow

        window = GrammarWindow(self._load(sampling))
        window.commit(sampling.output)
        self.windows[slot] = window

    def release(self, slot: int) -> None:
        self.windows.pop(slot, None)

    def commit(self, slots: list[int], rows: list[list[int]]) -> None:
        """A round's committed tokens. Those after a stop token the grammar took (its end)
        are not the grammar's: the request ends at the stop token (rank 0 drops them)."""
        for slot, row in zip(slots, rows):
            window = self.windows.get(slot)
            if window is None:
                continue
            window.rollback(window.pending)
            for token in row:
                if window.is_terminated:
                    break
                window.commit([token])

    def to_host(self, slots: list[int], tokens: torch.Tensor) -> HostCopy | None:
        """Start moving tokens ([B] or [B, k]) to the host, where the matchers run; None when
        no row has a grammar. Call it before queueing the forward whose time the masks
        should be built in."""
        return HostCopy(tokens) if any(s in self.windows for s in slots) else None

    def window_masks(self, slots: list[int], proposals: HostCopy | None) -> torch.Tensor | None:
        """bool [B, k + 1, V] on the device: each row's masks over a verify window of
        proposals [B, k] (to_host's; rows without a grammar: all True); None when no row has
        one."""
        if proposals is None:
            return None
        rows = proposals.values()
        return self._upload(slots, [self._packed(s, r) for s, r in zip(slots, rows)])

    def step_masks(self, slots: list[int]) -> torch.Tensor | None:
        """bool [B, 1, V]: each row's mask at its current position (after what it advanced
        over), None when no row has a grammar."""
        if not any(s in self.windows for s in slots):
            return None
        return self._upload(slots, [self._packed(s, []) for s in slots])

    def advance(self, slots: list[int], tokens: HostCopy | None) -> None:
        """Rows with a grammar move past their token (to_host's [B]: a proposal or a step's
        choice)."""
        if tokens is None:
            return
        for slot, token in zip(slots, tokens.values()):
            if slot in self.windows:
                self.windows[slot].advance(int(token))

    def rewind(self, slots: list[int]) -> None:
        """Undo every advance of these slots (the round's speculative tokens)."""
        for slot in slots:
            window = self.windows.get(slot)
            if window is not None:
                window.rollback(window.pending)

    def failures(self, slots: list[int]) -> list[str] | None:
        """Per slot, why its grammar's matcher failed ('' where it did not: the masks of a
        failed one allow only the stop tokens, runtime.speculation.grammar.window.GrammarWindow);
        None when none did."""
        windows = [self.windows.get(s) for s in slots]
        found = [(w.failure or "") if w is not None else "" for w in windows]
        return found if any(found) else None

    def _packed(self, slot: int, proposals: list[int]) -> torch.Tensor | None:
        """The slot's masks over `proposals`, packed (int32 [len + 1, ceil(V / 32)])."""
        window = self.windows.get(slot)
        return None if window is None else window.packed_masks(proposals)

    def _upload(self, slots: list[int], packed: list[torch.Tensor | None]) -> torch.Tensor:
        """The rows' packed masks (None: no grammar, all allowed) to the device, 32 times
        smaller than as bools, and unpacked there: bool [B, n, V]."""
        from runtime.speculation.grammar.window import ALL_ALLOWED, unpack_bitmask

        present = [(s, p) for s, p in zip(slots, packed) if p is not None]
        vocab = max(self.windows[s].vocab_size for s, _ in present)
        n, words = present[0][1].shape[0], (vocab + 31) // 32
        batch = torch.full((len(packed), n, words), ALL_ALLOWED, dtype=torch.int32)
        for i, p in enumerate(packed):
            if p is not None:
                batch[i, :, : p.shape[-1]] = p
        if self.device.type == "cuda":  # pinned: the copy is queued without waiting
            batch = batch.pin_memory()
        return unpack_bitmask(batch.to(self.device, non_blocking=True), vocab)

    def _load(self, sampling: Sampling):
        """The compiled grammar of `sampling` (from its wire form, or compiled here: a grammar
        rank 0 found quick to compile; cached by spec)."""
        from runtime.speculation.grammar.load import GrammarLoader, Prepared
        from runtime.speculation.grammar.spec import GrammarSpec

        if sampling.grammar_vocab and self._loader is None:
            import xgrammar as xgr

            info = zlib.decompress(base64.b64decode(sampling.grammar_vocab)).decode()
            self._loader = GrammarLoader(xgr.TokenizerInfo.deserialize_json(info))
        if self._loader is None:
            raise ValueError("a grammar came before the vocabulary it needs")
        wire = base64.b64decode(sampling.grammar_wire) if sampling.grammar_wire else None
        spec = GrammarSpec(sampling.grammar_kind, sampling.grammar_text)
        return self._loader.load(Prepared(spec, wire))
