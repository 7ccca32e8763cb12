"""A conversation, with tool calls and tools, as the chat template takes it (transformers'
apply_chat_template(messages, tools=...)): OpenAI's messages (an assistant message's
`tool_calls`, its content may be null; `role: "tool"` messages) in the shapes templates read,
and the prompt they render to. Pure: the server (Orchestrator.encode_chat) renders with it,
the HTTP front checks messages and counts prompt tokens with it.

What templates expect (Qwen 2.5's and Llama 3.1's render `tool_call.arguments | tojson`, so
the arguments must be a dict there; Qwen 3's takes a dict or a string; transformers' docs use
a dict): each call becomes {"id", "type": "function", "function": {"name", "arguments":
dict}}; arguments that are not a JSON object stay the string given. A null content becomes ""
(templates concatenate it). A tool message keeps its `tool_call_id` (Mistral's templates
render it) and `name` when given. Errors are ValueErrors naming `messages` (the front's 400)."""

from __future__ import annotations

import json


def chat_messages_with_tools(messages) -> list[dict]:
    """OpenAI's messages as the chat template's: {"role", "content": str} each (developer is
    system; text parts are joined by newlines), plus "tool_calls" on assistant messages and
    "tool_call_id" (and "name") on tool messages."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list of messages")
    return [_message(msg, i) for i, msg in enumerate(messages)]


def _message(msg, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ValueError(f"{where}: expected an object with a string 'role'")
    role = "system" if msg["role"] == "developer" else msg["role"]
    out: dict = {"role": role, "content": _content(msg.get("content"), where)}
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ValueError(f"{where}.tool_calls: only an assistant message makes tool calls")
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls: expected a list of tool calls")
        if calls:
            out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ValueError(f"{where}.tool_call_id: expected the id of the call answered")
        out["tool_call_id"] = call_id
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    return out


def _call(call, where: str) -> dict:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise ValueError(f'{where}: expected {{"type": "function", "function": {{...}}}}')
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function: expected an object with a string name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    elif not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments: expected a JSON string")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _content(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise ValueError(f"{where}.content: only text parts are supported")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ValueError(f"{where}.content: expected a string or a list of text parts")


def render_chat(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    tokenize: bool = True,
    name: str = "messages",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int] | str:
    """The prompt of a conversation (chat_messages_with_tools' shapes) with `tools` (OpenAI's
    {"type": "function", "function": {...}} list, or None) through the tokenizer's chat
    template, with the assistant's generation prompt (unless add_generation_prompt is False;
    continue_final_message leaves the last message open, as vLLM's /tokenize may ask): its
    token ids, or its text when tokenize is False. Template errors are ValueErrors naming
    `name`."""
    extra = {"continue_final_message": True} if continue_final_message else {}
    try:
        rendered = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            return_dict=False,
            **extra,
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors are not ValueErrors
        raise ValueError(f"{name}: the chat template failed: {exc}") from None
    if not tokenize:
        return str(rendered)
    return [int(t) for t in rendered]


def check_template_tools(tools) -> list[dict] | None:
    """`tools` as the template takes them: None, or a list of maps (their content is the
    client's to check: runtime.api.tools.request.check_tools)."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools: expected a list of function tools")
    return tools or None
