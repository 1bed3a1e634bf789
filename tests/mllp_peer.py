"""A laboratory system's MLLP listener for tests, written with python-hl7 (the ``hl7``
package), not with hl7apy that builds bagserve's messages: it parses every message it
receives and answers an ACK as its script says (``AA``, ``AE``, ``AR``, or ``DROP``:
close the connection without an answer); after the script, ``AA``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import hl7
import hl7.mllp


class Peer:
    def __init__(self, script: list[str] | None = None) -> None:
        self.script = list(script or [])
        self.received: list[hl7.Message] = []
        self.answers: list[str] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"mllp://127.0.0.1:{self.port}"

    async def _handle(
        self, reader: hl7.mllp.HL7StreamReader, writer: hl7.mllp.HL7StreamWriter
    ) -> None:
        try:
            while not writer.is_closing():
                message = await reader.readmessage()
                self.received.append(message)
                action = self.script.pop(0) if self.script else "AA"
                self.answers.append(action)
                if action == "DROP":
                    writer.close()
                    return
                ack = str(message.create_ack(action, message_id=f"ack{len(self.received)}"))
                if action != "AA":
                    ack = ack.rstrip("\r") + "|the peer says " + action
                writer.writemessage(hl7.parse(ack))
                await writer.drain()
        except asyncio.IncompleteReadError:
            return


@contextmanager
def mllp_peer(script: list[str] | None = None) -> Iterator[Peer]:
    """A running peer on 127.0.0.1 (a free port), stopped on exit."""
    peer = Peer(script)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: asyncio.Future[None] | None = None

    async def main() -> None:
        nonlocal stop
        stop = loop.create_future()
        async with await hl7.mllp.start_hl7_server(peer._handle, "127.0.0.1", 0) as server:
            peer.port = server.sockets[0].getsockname()[1]
            ready.set()
            await stop

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10), "the MLLP peer did not start"
    try:
        yield peer
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(10)
        loop.close()
