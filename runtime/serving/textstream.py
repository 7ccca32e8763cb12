"""Incremental detokenisation with stop strings.

Text is re-decoded from all generated ids (correct across multi-byte characters that span
tokens); what is emitted never ends in an incomplete character and never runs past, or into
the beginning of, a stop string.
"""

from __future__ import annotations


class TextStream:
    """include_stop: the stop string (or a stop token's text) stays in the text (vLLM's
    include_stop_str_in_output); skip_special: special tokens leave no text."""

    def __init__(
        self,
        tokenizer,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special: bool = True,
    ):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop, self.skip_special = include_stop, skip_special
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out
        self.search_from = 0  # stop strings are looked for from here (min_tokens)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(
        self, new_ids: list[int], check: bool = True, last_is_stop: bool = False
    ) -> tuple[list[int], bool]:
        """Append tokens; returns (the tokens kept, whether a stop string ended the text).
        check: look for stop strings (not before min_tokens: only text that ends after it
        counts); last_is_stop: the last token is a stop token, whose text is left out unless
        include_stop."""
        before = len(self.ids)
        self.ids.extend(new_ids)
        self.text = self._decode(self.ids)
        if last_is_stop and not self.include_stop:
            self.text = self._decode(self.ids[:-1])
        if not self.stop:
            return list(new_ids), False
        if not check:
            longest = max(len(s) for s in self.stop)
            self.search_from = max(0, len(self.text) - longest + 1)
            return list(new_ids), False
        hit = self._find_stop(self.text)
        if hit is None:
            return list(new_ids), False
        # keep the fewest new tokens whose text already contains the stop string
        for n in range(before + 1, len(self.ids) + 1):
            text = self._decode(self.ids[:n])
            cut = self._find_stop(text)
            if cut is not None:
                kept = self.ids[before:n]
                self.ids = self.ids[:n]
                self.text = text[: cut[1] if self.include_stop else cut[0]]
                return kept, True
        raise AssertionError("stop string vanished")  # pragma: no cover

    def _find_stop(self, text: str) -> tuple[int, int] | None:
        """(start, end) of the first stop string in text past search_from."""
        hits = [(i, i + len(s)) for s in self.stop if (i := text.find(s, self.search_from)) >= 0]
        return min(hits) if hits else None

    def delta(self, final: bool) -> str:
        """Text that is safe to emit now (all of it when final)."""
        end = len(self.text)
        if not final:
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1
            end -= self._held_for_stop(self.text[:end])
        end = max(end, self.emitted)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest suffix of text that begins some stop string."""
        held = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held
