"""The HTTP front's tokenizer endpoints, in vLLM's shapes: `POST /tokenize` and `POST
/detokenize`.

- /tokenize of a text: `{"model"?, "prompt": str, "add_special_tokens"?: bool (true),
  "return_token_strs"?: bool (false)}`; of a conversation: `{"model"?, "messages": [...],
  "add_generation_prompt"?: bool (true), "continue_final_message"?: bool (false),
  "add_special_tokens"?: bool (false), "tools"?, "return_token_strs"?}`. The reply:
  `{"count", "max_model_len", "tokens", "token_strs"}` (token_strs null unless asked for).
  With the defaults the ids are exactly the prompt the server generates from: a text as
  Orchestrator.encode makes it, a conversation as encode_chat (runtime/serving/chat.py).
- /detokenize: `{"model"?, "tokens": [int]}` -> `{"prompt": str}` (special tokens shown, as
  vLLM), so that it inverts /tokenize.

`model`, when given, must be the served name (404 otherwise, as the other routes). The
tokenizer is the server's, loaded in the front's process (runtime/api/openai/tokens.py's
TokenizerSource, shared with the other routes): the ZeroMQ protocol carries no text. A model
without a tokenizer is a 400; a front that cannot load it (standalone, on another host) a 503."""

from __future__ import annotations

import asyncio

from fastapi import Request

from runtime.api.http.routes import Routes
from runtime.api.openai.errors import HttpError
from runtime.api.openai.requests import check_args, value_error
from runtime.serving.chat import chat_messages_with_tools, check_template_tools, render_chat

TEXT_ARGS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
CHAT_ARGS = {
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "return_token_strs",
    "tools",
}
DETOKENIZE_ARGS = {"model", "tokens"}


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HttpError(400, f"{name}: expected a boolean", name)
    return value


def encode_text(tokenizer, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise HttpError(400, "prompt: expected a string", "prompt")
    special = _flag(body, "add_special_tokens", True)
    return list(tokenizer.encode(prompt, add_special_tokens=special))


def encode_chat(tokenizer, body: dict) -> list[int]:
    """A conversation's prompt ids: the template's own tokens, plus the tokenizer's special
    tokens on top when add_special_tokens is true."""
    generation = _flag(body, "add_generation_prompt", True)
    final_open = _flag(body, "continue_final_message", False)
    special = _flag(body, "add_special_tokens", False)
    if generation and final_open:
        raise HttpError(
            400,
            "continue_final_message: cannot be true with add_generation_prompt true",
            "continue_final_message",
        )
    try:
        messages = chat_messages_with_tools(body.get("messages"))
        tools = check_template_tools(body.get("tools"))
        rendered = render_chat(
            tokenizer,
            messages,
            tools,
            tokenize=not special,
            add_generation_prompt=generation,
            continue_final_message=final_open,
        )
    except ValueError as exc:
        raise value_error(exc, "max_tokens", "messages") from None
    if isinstance(rendered, str):
        return list(tokenizer.encode(rendered, add_special_tokens=True))
    return rendered


def check_token_ids(tokens, vocab_size: int | None) -> list[int]:
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise HttpError(400, "tokens: expected a list of token ids (integers)", "tokens")
    bad = [t for t in tokens if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise HttpError(
            400,
            f"tokens: {bad[0]} is not a token id of this model (0 <= id < {vocab_size})",
            "tokens",
        )
    return tokens


class TokenizerRoutes:
    """/tokenize and /detokenize over the Routes' server info and tokenizer."""

    def __init__(self, routes: Routes):
        self.routes = routes

    async def tokenizer(self, body: dict):
        """(the server's tokenizer, the server's info), the model named checked."""
        if body.get("model") is not None:
            await self.routes.check_model(body)
        info = await self.routes.info()
        if not info.get("has_tokenizer", True):
            raise HttpError(400, "this model has no tokenizer: it takes token ids only")
        strings = await self.routes.tokens.get(info)
        if strings.tokenizer is None:
            raise HttpError(
                503,
                "the HTTP front cannot load the server's tokenizer (its log says why)",
                kind="server_error",
                code="tokenizer_unavailable",
            )
        return strings.tokenizer, info

    async def tokenize(self, request: Request):
        body = await self.routes.read_body(request)
        chat = "messages" in body
        if chat and "prompt" in body:
            raise HttpError(400, "give `prompt` or `messages`, not both", "messages")
        check_args(body, CHAT_ARGS if chat else TEXT_ARGS, {})
        tokenizer, info = await self.tokenizer(body)
        encode = encode_chat if chat else encode_text
        ids = await asyncio.to_thread(encode, tokenizer, body)
        strs = None
        if _flag(body, "return_token_strs", False):
            strs = list(tokenizer.convert_ids_to_tokens(ids))
        return {
            "count": len(ids),
            "max_model_len": info.get("max_seq_len"),
            "tokens": ids,
            "token_strs": strs,
        }

    async def detokenize(self, request: Request):
        body = await self.routes.read_body(request)
        check_args(body, DETOKENIZE_ARGS, {})
        tokenizer, info = await self.tokenizer(body)
        ids = check_token_ids(body.get("tokens"), info.get("vocab_size"))
        try:
            text = await asyncio.to_thread(tokenizer.decode, ids, skip_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - ids past the tokenizer's own table
            raise HttpError(400, f"tokens: cannot be decoded: {exc}", "tokens") from None
        return {"prompt": text}
