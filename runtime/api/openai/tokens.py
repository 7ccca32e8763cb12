"""Token ids as text for the HTTP front: the strings of logprobs' tokens, an echoed token-id
prompt's text, and the prompt token counts of continuous usage stats.

The server owns the tokenizer (runtime/serving/orchestrator.py loads it with
runtime.models.loading.tokenizer.load_tokenizer); the front loads the same one, with the
same function, in its own process, the first time a request needs it (one asking for
logprobs, echoing a token-id prompt, or for usage on every chunk), never otherwise: a
request that needs no token strings costs nothing, and the ZeroMQ protocol stays the
engine's (ids and logprobs, no strings). Where it comes from: the path `tandem serve`
hands the front (the config's tokenizer_path), else the server's info() ("tokenizer", else
"model": the target's checkpoint). A front that cannot load it (standalone, on another host)
logs so once and names tokens as vLLM's return_tokens_as_token_ids does ("token_id:N")."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from runtime.serving.chat import render_chat

log = logging.getLogger("tandem.http")


class TokenStrings:
    """One tokenizer's token strings (each id decoded alone, special tokens shown)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._strings: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._strings.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._strings[token_id] = text
        return text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """A token-id prompt's text (echo); empty without a tokenizer."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids, as the server's Orchestrator.encode makes them."""
        if self.tokenizer is None:
            return []
        return list(self.tokenizer.encode(text))

    def count_chat(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        """A conversation's prompt tokens, as the server's Orchestrator.encode_chat makes them
        (0 when the template fails here: the server answers that request with its error)."""
        if self.tokenizer is None:
            return 0
        try:
            return len(render_chat(self.tokenizer, messages, tools))
        except ValueError:  # the server reports template errors
            return 0


class TokenizerSource:
    """The front's TokenStrings, loaded once on first need (off the event loop)."""

    def __init__(self, path: str | None = None):
        self.path = path  # given by `tandem serve`; else found in the server's info()
        self._strings: TokenStrings | None = None
        self._lock: asyncio.Lock | None = None

    async def get(self, info: dict) -> TokenStrings:
        if self._strings is not None:
            return self._strings
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._strings is None:
                self._strings = TokenStrings(await asyncio.to_thread(self._load, info))
        return self._strings

    def _load(self, info: dict):
        from runtime.models.loading.tokenizer import load_tokenizer

        path = self.path
        if path is None and info.get("has_tokenizer", True):
            path = info.get("tokenizer") or info.get("model")
        if not path:
            return None
        try:
            return load_tokenizer(str(path))
        except Exception as exc:  # noqa: BLE001 - a front elsewhere may not see the files
            log.warning(
                "cannot load the tokenizer at %s (%s): logprobs name tokens 'token_id:N'",
                path,
                exc,
            )
            return None


@dataclass(frozen=True)
class Echo:
    """A prompt as an echoing completion shows it."""

    text: str
    ids: list[int]  # its tokens, when logprobs are shown (else empty)


@dataclass(frozen=True)
class Render:
    """What a response shows beyond the server's outputs: token strings, the echoed prompts
    and (stream_options.continuous_usage_stats) each prompt's token count."""

    text_of: TokenStrings = field(default_factory=TokenStrings)
    echoes: tuple[Echo, ...] = ()  # per prompt (echo)
    prompt_tokens: tuple[int, ...] = ()  # per prompt (usage on every chunk)


def _prompts(build_kwargs: dict) -> tuple[list[str] | None, list[list[int]] | None]:
    """The request's prompts as texts, or as token-id rows (already validated)."""
    ids = build_kwargs.get("prompt_token_ids")
    if ids is not None:
        return None, [list(ids)] if all(isinstance(t, int) for t in ids) else list(ids)
    prompt = build_kwargs.get("prompt")
    if prompt is None:
        return None, None
    return ([prompt] if isinstance(prompt, str) else list(prompt)), None


def needs_tokenizer(build_kwargs: dict, logprobs: bool, echo: bool, continuous: bool) -> bool:
    _, ids = _prompts(build_kwargs)
    return logprobs or (echo and ids is not None) or (continuous and ids is None)


def make_render(
    build_kwargs: dict, strings: TokenStrings, logprobs: bool, echo: bool, continuous: bool
) -> Render:
    """The Render of one request (`build_kwargs` as HttpClient.build took them)."""
    texts, rows = _prompts(build_kwargs)
    echoes: tuple[Echo, ...] = ()
    if echo and rows is not None:
        skip = build_kwargs["params"].get("skip_special_tokens")
        skip = True if skip is None else bool(skip)
        echoes = tuple(Echo(strings.decode(r, skip), r if logprobs else []) for r in rows)
    elif echo and texts is not None:
        echoes = tuple(Echo(t, strings.encode(t) if logprobs else []) for t in texts)
    counts: tuple[int, ...] = ()
    if continuous:
        if rows is not None:
            counts = tuple(len(r) for r in rows)
        elif texts is not None:
            counts = tuple(len(strings.encode(t)) for t in texts)
        else:
            counts = (strings.count_chat(build_kwargs["messages"], build_kwargs.get("tools")),)
    return Render(strings, echoes, counts)
