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
from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

from runtime.api.http.routes import Routes
from runtime.api.openai.bodies import Body
from runtime.api.openai.errors import HttpError
from runtime.api.openai.fields import Flag, TokenIds
from runtime.api.openai.requests import value_error
from runtime.api.openai.schemas import MESSAGES, TOOLS
from runtime.errors import naming
from runtime.serving.chat import chat_messages_with_tools, check_template_tools, render_chat


class TokenizeRequest(Body):
    """A text (`prompt`) or a conversation (`messages`) to tokenize, as vLLM's /tokenize."""

    model: str | None = Field(None, min_length=1, description="the served model's id")
    prompt: str | None = Field(None, description="a text (give it or messages)")
    messages: Annotated[Any, WithJsonSchema(MESSAGES)] = Field(
        None, description="a conversation, through the chat template (give it or prompt)"
    )
    tools: Annotated[Any, WithJsonSchema(TOOLS)] = Field(
        None, description="tools shown to the chat template"
    )
    add_special_tokens: Flag | None = Field(
        None,
        description="the tokenizer's special tokens on top (default: true for a text, "
        "false for a conversation, whose template holds its own)",
    )
    add_generation_prompt: Flag = Field(True, description="the assistant's turn opened")
    continue_final_message: Flag = Field(False, description="the last message left open")
    return_token_strs: Flag = Field(False, description="each token's string too")


class DetokenizeRequest(Body):
    model: str | None = Field(None, min_length=1, description="the served model's id")
    tokens: TokenIds = Field(description="token ids to decode (special tokens shown)")


def encode_text(tokenizer, body: TokenizeRequest) -> list[int]:
    special = True if body.add_special_tokens is None else body.add_special_tokens
    return list(tokenizer.encode(body.prompt, add_special_tokens=special))


def encode_chat(tokenizer, body: TokenizeRequest) -> list[int]:
    """A conversation's prompt ids: the template's own tokens, plus the tokenizer's special
    tokens on top when add_special_tokens is true."""
    special = bool(body.add_special_tokens)
    if body.add_generation_prompt and body.continue_final_message:
        raise HttpError(
            400,
            "continue_final_message: cannot be true with add_generation_prompt true",
            "continue_final_message",
        )
    try:
        with naming("messages"):
            messages = chat_messages_with_tools(body.messages)
        with naming("tools"):
            tools = check_template_tools(body.tools)
        rendered = render_chat(
            tokenizer,
            messages,
            tools,
            tokenize=not special,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )
    except ValueError as exc:
        raise value_error(exc, "max_tokens", "messages") from None
    if isinstance(rendered, str):
        return list(tokenizer.encode(rendered, add_special_tokens=True))
    return rendered


def check_token_ids(tokens: list[int], vocab_size: int | None) -> list[int]:
    bad = [t for t in tokens if vocab_size is not None and t >= vocab_size]
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

    async def tokenizer(self, model: str | None):
        """(the server's tokenizer, the server's info), the model named checked."""
        if model is not None:
            await self.routes.check_model(model)
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

    async def tokenize(self, body: TokenizeRequest):
        chat = body.messages is not None
        if chat == (body.prompt is not None):
            raise HttpError(
                400, "give `prompt` or `messages` (one of them)", "messages" if chat else "prompt"
            )
        if not chat and body.tools is not None:
            raise HttpError(400, "tools: only with messages", "tools")
        tokenizer, info = await self.tokenizer(body.model)
        encode = encode_chat if chat else encode_text
        ids = await asyncio.to_thread(encode, tokenizer, body)
        strs = list(tokenizer.convert_ids_to_tokens(ids)) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": info.get("max_seq_len"),
            "tokens": ids,
            "token_strs": strs,
        }

    async def detokenize(self, body: DetokenizeRequest):
        tokenizer, info = await self.tokenizer(body.model)
        ids = check_token_ids(body.tokens, info.get("vocab_size"))
        try:
            text = await asyncio.to_thread(tokenizer.decode, ids, skip_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - ids past the tokenizer's own table
            raise HttpError(400, f"tokens: cannot be decoded: {exc}", "tokens") from None
        return {"prompt": text}
