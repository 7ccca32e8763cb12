"""The JSON Schemas that /openapi.json shows for the request arguments checked where they are
used rather than by their pydantic type (runtime/api/openai/bodies.py): a chat's messages
(runtime/serving/chat.py), tools and tool_choice (tools/request.py), response_format and
structured_outputs (openai/structured.py). Their checks name the part at fault
("messages[2].tool_call_id: ..."), which a pydantic type would not say the same way."""

from __future__ import annotations

_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_TOOL_CALL = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"enum": ["function"]},
        "function": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "the arguments as JSON text"},
            },
            "required": ["name", "arguments"],
        },
    },
    "required": ["function"],
}
MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": _TEXT_PART},
                    {"type": "null"},
                ],
                "description": "text, or text parts (joined by newlines)",
            },
            "name": {"type": "string"},
            "tool_calls": {"type": "array", "items": _TOOL_CALL},
            "tool_call_id": {"type": "string", "description": "a tool message: the call answered"},
        },
        "required": ["role"],
    },
}
_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}
TOOLS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "type": {"enum": ["function"]},
            "function": {
                "type": "object",
                "properties": {
                    "name": _NAME,
                    "description": {"type": "string"},
                    "parameters": {"type": "object", "description": "a JSON Schema of type object"},
                    "strict": {"type": "boolean"},
                },
                "required": ["name"],
            },
        },
        "required": ["type", "function"],
    },
}
TOOL_CHOICE = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "properties": {
                "type": {"enum": ["function"]},
                "function": {
                    "type": "object",
                    "properties": {"name": _NAME},
                    "required": ["name"],
                },
            },
            "required": ["type", "function"],
        },
    ]
}
RESPONSE_FORMAT = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object"]}},
            "required": ["type"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"enum": ["json_schema"]},
                "json_schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": {"type": "boolean"},
                    },
                    "required": ["name"],
                },
            },
            "required": ["type", "json_schema"],
        },
    ]
}
STRUCTURED_OUTPUTS = {
    "type": "object",
    "description": "exactly one of these",
    "properties": {
        "json": {"type": "object", "description": "a JSON Schema"},
        "regex": {"type": "string"},
        "choice": {"type": "array", "items": {"type": "string"}},
        "grammar": {"type": "string", "description": "EBNF (GBNF)"},
        "lark": {"type": "string", "description": "a Lark grammar (llguidance)"},
        "json_object": {"enum": [True], "description": "any JSON object"},
    },
    "minProperties": 1,
    "maxProperties": 1,
}
