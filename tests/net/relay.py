"""A TCP relay that delays every byte by a fixed time each way: latency between two hosts.

This kernel has no netem qdisc, so latency is added in userspace, inside the client's host:
the client connects to the relay on its own loopback, the relay to the real peer. Order is
kept, and a later chunk never overtakes an earlier one.

    python tests/net/relay.py --listen 127.0.0.1:16379 --to 10.200.1.1:6379 --delay-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                delay_s: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, chunk = await queue.get()
            if not chunk:
                writer.close()
                return
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()

    sender = asyncio.ensure_future(deliver())
    try:
        while chunk := await reader.read(65536):
            queue.put_nowait((time.monotonic() + delay_s, chunk))
    except ConnectionError:
        pass
    queue.put_nowait((time.monotonic() + delay_s, b""))
    await sender


async def _serve(listen: str, to: str, delay_s: float) -> None:
    host, port = to.rsplit(":", 1)

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            peer_r, peer_w = await asyncio.open_connection(host, int(port))
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pump(client_r, peer_w, delay_s), _pump(peer_r, client_w, delay_s),
                             return_exceptions=True)

    lhost, lport = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, lhost, int(lport))
    print(f"RELAY_READY {listen} -> {to} +{delay_s * 1000:.0f} ms", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept on")
    parser.add_argument("--to", required=True, help="HOST:PORT to relay to")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay (ms)")
    args = parser.parse_args()
    asyncio.run(_serve(args.listen, args.to, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
