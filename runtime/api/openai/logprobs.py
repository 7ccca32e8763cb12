"""OpenAI's logprobs shapes from the server's: per token a list of [token id, logprob] pairs,
the chosen token first, then its top N alternatives (runtime.control.protocol Delta and
Final), or None (a prompt's first token).

- /v1/completions (OpenAI's legacy shape, as vLLM returns it): {"tokens": [str],
  "token_logprobs": [float|None], "top_logprobs": [{str: float}|None], "text_offset": [int]};
  a token's top_logprobs holds the chosen token and its top N (up to N + 1 entries).
- /v1/chat/completions: {"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}]}]}, top_logprobs the N most likely, most likely first.

A token's string is its id decoded alone (runtime.api.openai.tokens.TokenStrings); `bytes`
its UTF-8 bytes. -inf (a token the logit_bias or a filter ruled out) is -9999.0, as vLLM
gives it: JSON has no infinity."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf

Entry = Sequence[Sequence] | None  # one token's [[id, logprob], ...], or None
TokenText = Callable[[int], str]


def clamp(logprob: float) -> float:
    value = float(logprob)
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


def _chosen(token_id: int, entry: Sequence[Sequence]) -> float:
    for tid, logprob in entry:
        if int(tid) == token_id:
            return clamp(logprob)
    return clamp(entry[0][1])


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[Entry], text_of: TokenText, offset: int = 0
) -> dict:
    """The legacy logprobs object of `token_ids` (one entry each); text offsets count from
    `offset` (the text already sent of this choice)."""
    out = empty_completion_logprobs()
    for token_id, entry in zip(token_ids, entries):
        text = text_of(int(token_id))
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_chosen(int(token_id), entry))
        top: dict[str, float] = {}
        for tid, logprob in entry:  # the chosen first: a string two ids share keeps its value
            top.setdefault(text_of(int(tid)), clamp(logprob))
        out["top_logprobs"].append(top)
    return out


def _item(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[Entry], text_of: TokenText, top_n: int
) -> dict:
    """The chat logprobs object of `token_ids` (one entry each) with `top_n` alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        pairs = list(entry or [])
        logprob = _chosen(int(token_id), pairs) if pairs else MIN_LOGPROB
        item = _item(text_of(int(token_id)), logprob)
        ranked = sorted(pairs, key=lambda pair: -float(pair[1]))[:top_n]
        item["top_logprobs"] = [_item(text_of(int(t)), clamp(lp)) for t, lp in ranked]
        content.append(item)
    return {"content": content}


def empty_completion_logprobs() -> dict[str, list]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
