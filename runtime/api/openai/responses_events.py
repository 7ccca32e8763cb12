"""One response of POST /v1/responses as it is generated: the Responses API's stream events
and the response object they add up to (openai/responses_objects.py). The whole (non-streamed)
response is the same machine fed the whole text, so a stream and a whole reply agree.

The events, each with a growing sequence_number: response.created and response.in_progress
(the response, no output yet); for the assistant's text, response.output_item.added (a
message), response.content_part.added (an output_text part), response.output_text.delta...,
then response.output_text.done, response.content_part.done, response.output_item.done; for
each tool call, response.output_item.added (a function_call item), response.function_call_
arguments.delta..., response.function_call_arguments.done, response.output_item.done; last
response.completed with the whole response (its status "incomplete", incomplete_details
max_output_tokens, when the output was cut short: the last item is then "incomplete"), or
response.failed with its error. The text is read for tool calls as a chat completion's is
(runtime/api/tools/parsers.py: the same formats, the ToolCallStream's deltas)."""

from __future__ import annotations

from runtime.api.openai.errors import HttpError
from runtime.api.openai.responses_objects import (
    ErrorDetails,
    FunctionCallItem,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    Status,
    usage_of,
)
from runtime.api.tools.parsers import ToolCallStream


class ResponseEvents:
    """The events of `response` as its text comes (feed), and its end (finish or fail);
    `reader`: the output read for tool calls (None: all of it is the message's text)."""

    def __init__(self, response: ResponseObject, reader: ToolCallStream | None = None):
        self.response = response
        self.reader = reader
        self.sequence = 0
        self.open: OutputItem | None = None  # the last output item, until it is done

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def snapshot(self) -> dict:
        return self.response.model_dump(mode="json")

    def opening(self) -> list[dict]:
        return [
            self.event("response.created", response=self.snapshot()),
            self.event("response.in_progress", response=self.snapshot()),
        ]

    def feed(self, text: str) -> list[dict]:
        """The events of `text`, generated after what was fed before."""
        if self.reader is None:
            return self._text(text) if text else []
        return self._apply(self.reader.feed(text))

    def finish(self, out: dict) -> list[dict]:
        """The events that end the response: its last item done, response.completed (`out`:
        the server's output: finish_reason, token_ids, stats)."""
        events = [] if self.reader is None else self._apply(self.reader.finish())
        forced = self.reader is not None and self.reader.forced
        if not self.response.output and not forced:
            events += self._open_message()  # an empty answer is an empty message
        cut = out.get("finish_reason") == "length"
        events += self._close("incomplete" if cut else "completed")
        self.response.status = "incomplete" if cut else "completed"
        self.response.incomplete_details = IncompleteDetails() if cut else None
        self.response.usage = usage_of(out)
        return [*events, self.event("response.completed", response=self.snapshot())]

    def fail(self, error: HttpError) -> list[dict]:
        """The events of a response that failed after it began (response.failed)."""
        events = self._close("incomplete")
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        self.response.status = "failed"
        self.response.error = ErrorDetails(code=code, message=error.message)
        return [*events, self.event("response.failed", response=self.snapshot())]

    def whole(self, out: dict) -> ResponseObject:
        """The whole response of one output (the events are not kept)."""
        self.feed(out["text"])
        self.finish(out)
        return self.response

    # --- items -----------------------------------------------------------------------------
    def _apply(self, deltas: list[dict]) -> list[dict]:
        """The events of ToolCallStream's chat deltas."""
        events: list[dict] = []
        for delta in deltas:
            if "content" in delta:
                events += self._text(delta["content"])
                continue
            for call in delta["tool_calls"]:
                function = call["function"]
                if "id" in call:
                    events += self._start_call(call["id"], function["name"])
                events += self._arguments(function.get("arguments") or "")
        return events

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    def _text(self, text: str) -> list[dict]:
        events = [] if isinstance(self.open, OutputMessage) else self._open_message()
        message = self.open
        assert isinstance(message, OutputMessage)
        message.content[0].text += text
        where = {"item_id": message.id, "output_index": self._index, "content_index": 0}
        return [*events, self.event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def _open_message(self) -> list[dict]:
        events = self._close("completed")
        message = OutputMessage()
        events += self._add(message)
        part = OutputText()
        message.content.append(part)
        where = {"item_id": message.id, "output_index": self._index, "content_index": 0}
        part_added = self.event("response.content_part.added", **where, part=part.model_dump())
        return [*events, part_added]

    def _start_call(self, call_id: str, name: str) -> list[dict]:
        events = self._close("completed")
        return events + self._add(FunctionCallItem(call_id=call_id, name=name))

    def _arguments(self, text: str) -> list[dict]:
        call = self.open
        if not text or not isinstance(call, FunctionCallItem):
            return []
        call.arguments += text
        where = {"item_id": call.id, "output_index": self._index}
        return [self.event("response.function_call_arguments.delta", **where, delta=text)]

    def _add(self, item: OutputItem) -> list[dict]:
        self.response.output.append(item)
        self.open = item
        added = item.model_dump(mode="json")
        return [self.event("response.output_item.added", output_index=self._index, item=added)]

    def _close(self, status: Status) -> list[dict]:
        """The open item done (with `status`)."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": self._index}
        events = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            text_done = self.event("response.output_text.done", **where, content_index=0)
            events += [{**text_done, "text": part.text, "logprobs": []}]
            part_done = self.event("response.content_part.done", **where, content_index=0)
            events += [{**part_done, "part": part.model_dump()}]
        else:
            args_done = self.event("response.function_call_arguments.done", **where)
            events += [{**args_done, "arguments": item.arguments}]
        item.status = status
        done = self.event("response.output_item.done", output_index=self._index)
        return [*events, {**done, "item": item.model_dump(mode="json")}]
