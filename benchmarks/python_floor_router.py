"""The floor of a Python PD router: what uvicorn (httptools, uvloop) and aiohttp cost alone.

A benchmark instrument, not a router: raw ASGI, no FastAPI, no features, no view, no
policy (prefill workers in turn), no booking, no metrics, no validation of the answer, no
retry. Per request it reads the body, splices SGLang's bootstrap fields into it, POSTs it to
one prefill worker and to the decode worker concurrently and answers decode's body. What
`smetric router` spends above this row is the router's own work; what this row spends above
a Rust router is the price of Python's HTTP stack. `benchmarks/router_overhead.py` runs it
beside the routers.

    python benchmarks/python_floor_router.py --port 8100 --prefill URL [--prefill URL ...] --decode URL
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
from urllib.parse import urlsplit

import aiohttp
import orjson
import uvicorn

_JSON = {"content-type": "application/json"}


class FloorRouter:
    def __init__(self, prefill: list[str], decode: str) -> None:
        self.prefill = itertools.cycle([(u, urlsplit(u).hostname or "127.0.0.1") for u in prefill])
        self.decode = decode
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["path"] == "/health":
            await _answer(send, 200, b"ok", b"text/plain")
        else:
            await self._forward(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0),
                    auto_decompress=False,
                    skip_auto_headers=("User-Agent",),
                )
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope, receive, send) -> None:
        parts = []
        more = True
        while more:
            msg = await receive()
            parts.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        raw = b"".join(parts).rstrip()
        url, host = next(self.prefill)
        boot = {"bootstrap_host": host, "bootstrap_port": 8998, "bootstrap_room": secrets.randbits(63)}
        data = raw[:-1] + b"," + orjson.dumps(boot)[1:]
        path = scope["path"]
        prefill = asyncio.ensure_future(self._drain(url + path, data))
        async with self.session.post(self.decode + path, data=data, headers=_JSON) as r:
            status, body = r.status, await r.read()
        await prefill
        await _answer(send, status, body, b"application/json")

    async def _drain(self, url: str, data: bytes) -> None:
        async with self.session.post(url, data=data, headers=_JSON) as r:
            await r.read()


async def _answer(send, status: int, body: bytes, ctype: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
    await send({"type": "http.response.body", "body": body})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", action="append", required=True, metavar="URL")
    ap.add_argument("--decode", required=True, metavar="URL")
    a = ap.parse_args()
    app = FloorRouter(a.prefill, a.decode)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
