"""The Client that the OpenAI-compatible HTTP front talks to the server with: its requests
reply into asyncio queues (woken from the Client's I/O thread) instead of blocking threads."""

from __future__ import annotations

import asyncio

from runtime.api.client import Client
from runtime.control.protocol import Cancel, ClientReply, Generate
from runtime.params import SamplingParams


class AsyncWaiter:
    """Stands in for the Client's per-request reply queue; the Client's I/O thread puts."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[ClientReply] = asyncio.Queue()

    def put(self, msg: ClientReply) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, msg)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    async def get(self, timeout: float | None = None) -> ClientReply:
        if timeout is None:
            return await self.queue.get()
        return await asyncio.wait_for(self.queue.get(), timeout)


class HttpClient(Client):
    """A Client whose requests reply into asyncio queues instead of blocking threads."""

    def open_async(self, msg: Generate) -> AsyncWaiter:
        return self._open(msg, AsyncWaiter(asyncio.get_running_loop()))

    def finish(self, rid: str, cancel: bool) -> None:
        self._close_waiter(rid)
        if cancel and self._dead is None and not self._closed.is_set():
            self._post(Cancel(rid))

    def build(
        self,
        *,
        prompt=None,
        prompt_token_ids=None,
        messages=None,
        tools=None,
        params: dict,
        stream: bool,
    ) -> Generate:
        """The generate message (arguments validated here: ValueError names them); `tools`
        (checked already) go with `messages`."""
        if messages is not None:
            checked = SamplingParams.from_kwargs(**params).to_dict()
            return Generate(self._new_id(), checked, stream, messages=messages, tools=tools)
        msg, _ = self._request(prompt, prompt_token_ids, params, stream, chat=False)
        return msg
