"""Tools on the server's side and on the wire: the chat template with tools and tool
results (Orchestrator.encode_chat, runtime.serving.chat), the Client's tools=, Generate.tools
(JSON schemas nest deep) and the server.tool_parser key."""

from __future__ import annotations

import copy
import json

import msgpack
import pytest

from runtime.api.client import Client
from runtime.api.tools.parsers import PARSERS
from runtime.config import ConfigError
from runtime.config.schema import ServerConfig
from runtime.config.values import TOOL_PARSERS
from runtime.control import protocol
from runtime.control.protocol import Generate
from runtime.serving.orchestrator import Orchestrator
from tests.chat_templates import QWEN_TEMPLATE

pytestmark = pytest.mark.timeout(60)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


@pytest.fixture(scope="module")
def hermes_tokenizer():
    from tests.checkpoints import smollm2_tokenizer

    tokenizer = copy.deepcopy(smollm2_tokenizer())
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


def test_the_server_renders_tools_and_tool_results(hermes_tokenizer):
    orch = Orchestrator.__new__(Orchestrator)  # encode_chat needs only the tokenizer
    orch.tokenizer = hermes_tokenizer
    text = hermes_tokenizer.decode(orch.encode_chat(HISTORY, TOOLS))
    assert json.dumps(TOOLS[0]) in text and '<tool_response>\n{"temp": 21}' in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "# Tools" in hermes_tokenizer.decode(orch.encode("hi", chat=True, tools=TOOLS))
    assert "# Tools" not in hermes_tokenizer.decode(orch.encode("hi", chat=True))
    with pytest.raises(ValueError, match=r"^messages\[0\].tool_call_id"):
        orch.encode_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="^tools: "):
        orch.encode_chat(USER, tools="get_weather")  # type: ignore[arg-type]


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def test_the_clients_tools_and_the_wire(tmp_path):
    client = Client(f"ipc://{tmp_path}/nobody.sock", connect_timeout_s=0.5)
    try:
        with pytest.raises(ValueError, match="^tools: only a chat prompt"):
            client.generate("x", tools=TOOLS)
        with pytest.raises(ValueError, match=r"^tools\[0\]"):
            client.generate("x", chat=True, tools=[{"type": "function"}])
        deep = [{"type": "function", "function": {"name": "f", "parameters": _deep(10)}}]
        msg, single = client._request("x", None, {}, False, True, deep)
    finally:
        client.close()
    assert single and msg.tools == deep and msg.chat
    assert protocol.decode(protocol.encode(msg)) == msg  # JSON schemas nest deep
    plain = protocol.encode(Generate("r", {}, False, messages=USER))
    assert "tools" not in msgpack.unpackb(plain)  # no tools: no field


def test_server_tool_parser_key():
    assert TOOL_PARSERS == PARSERS
    assert ServerConfig().tool_parser is None
    assert ServerConfig(tool_parser="llama3_json").tool_parser == "llama3_json"
    with pytest.raises(ConfigError, match="server.tool_parser"):
        ServerConfig(tool_parser="mistral")
