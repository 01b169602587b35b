"""A hostile realtime "server" for the tests of `duplex eval run --server`: it speaks the
realtime API's opening (`session.created`, then `response.created` once audio comes) and then
sends audio deltas of --mib MiB each, as fast as it can, for --seconds. Independent of duplex:
the `websockets` package. Prints its port, then serves until killed.

    flooding_server.py [--mib 6] [--seconds 20]
"""

import argparse
import asyncio
import base64
import json
import time

from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed


async def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=6)
    p.add_argument("--seconds", type=float, default=20.0)
    a = p.parse_args()
    big = json.dumps({
        "type": "response.output_audio.delta",
        "delta": base64.b64encode(b"\x01\x00" * (a.mib << 19)).decode(),
    })

    async def handler(ws):
        try:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.created", "session": {"id": "sess_1"}}))
            await ws.recv()
            await ws.send(json.dumps({"type": "response.created"}))
            t0 = time.monotonic()
            while time.monotonic() - t0 < a.seconds:
                await ws.send(big)
        except ConnectionClosed:
            pass

    def only_realtime(connection, request):
        if request.path.split("?")[0] != "/v1/realtime":
            return connection.respond(404, "not here\n")
        return None

    async with serve(handler, "127.0.0.1", 0, max_size=None,
                     process_request=only_realtime) as server:
        port = server.sockets[0].getsockname()[1]
        print(port, flush=True)
        await asyncio.Future()


if __name__ == "__main__":
    asyncio.run(main())
