"""A laboratory system's MLLP listener for tests, written with python-hl7 (the ``hl7``
package), not with hl7apy that builds bagserve's messages: it parses every message it
receives and answers as its script says, one action per message; after the script,
``AA``:

* ``AA``, ``AE``, ``AR``: an ACK with that code for the message's control id;
* ``OTHER``: an ``AA`` that acknowledges another control id;
* ``GARBAGE``: a framed answer that is no HL7 message;
* ``DROP``: close the connection without an answer;
* ``SILENT``: keep the connection open and never answer (a hung system).
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
        self.closing: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"mllp://127.0.0.1:{self.port}"

    def control_ids(self) -> list[str]:
        """MSH-10 of every message received, in order."""
        return [str(m.segment("MSH")[10]) for m in self.received]

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
                if action == "SILENT":
                    assert self.closing is not None
                    await self.closing.wait()
                    writer.close()
                    return
                if action == "GARBAGE":
                    writer.write(b"\x0bthis is no HL7 message\x1c\r")
                    await writer.drain()
                    continue
                code = "AA" if action == "OTHER" else action
                ack = message.create_ack(code, message_id=f"ack{len(self.received)}")
                if action == "OTHER":
                    ack.segment("MSA")[2] = "SOMEOTHERMESSAGE"
                text = str(ack)
                if code != "AA":
                    text = text.rstrip("\r") + "|the peer says " + code
                writer.writemessage(hl7.parse(text))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
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
        peer.closing = asyncio.Event()
        async with await hl7.mllp.start_hl7_server(peer._handle, "127.0.0.1", 0) as server:
            peer.port = server.sockets[0].getsockname()[1]
            ready.set()
            await stop
            peer.closing.set()  # silent connections end before the server closes

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10), "the MLLP peer did not start"
    try:
        yield peer
    finally:
        assert stop is not None

        def finish() -> None:
            assert stop is not None
            stop.set_result(None)

        loop.call_soon_threadsafe(finish)
        thread.join(10)
        loop.close()
