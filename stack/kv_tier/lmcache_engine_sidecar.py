"""A real LMCache engine beside one emulated worker, run in LMCache's own environment.

    /opt/lmcache-venv/bin/python -m stack.kv_tier.lmcache_engine_sidecar \\
        --instance-id prefill-0 --port 30005 --controller 127.0.0.1:8300,127.0.0.1:8400 \\
        --worker-port 8500 --mooncake-master 127.0.0.1:50051 [--kv-bytes-per-token 16]

This module imports LMCache and torch and nothing from the project, so it runs under LMCache's
interpreter (``.ci/install-lmcache.sh``; LMCache's pins clash with the project's environment).
It builds LMCache's engine the way LMCache's own standalone starter does (CPU backend, no GPU),
with:

- the Mooncake store behind it as LMCache's remote tier (``mooncakestore://MASTER``): chunks one
  worker stores are found and loaded by another worker's engine (a migrated follow-up);
- LMCache's controller (``lmcache_controller``) told of every chunk it admits (LMCache's worker
  reporting), so the router's view (:mod:`stack.kv_tier.lmcache_view`) can ask who holds what;
- a connector that copies the emulated worker's real KV bytes into LMCache's chunks and back
  (``kv_bytes_per_token`` bytes per token; LMCache's own mock connector moves nothing).

The emulated worker talks to it over HTTP/JSON (KV as base64): ``POST /store {"tokens",
"kv_b64"}`` -> ``{"stored_tokens"}``; ``POST /lookup {"tokens"}`` -> ``{"hit_tokens"}``;
``POST /retrieve {"tokens"}`` -> ``{"hit_tokens", "kv_b64"}`` (the bytes of the hit prefix);
``GET /health``. LMCache works in whole chunks (``--chunk-size``, 256): a partial last chunk
is neither stored nor hit. A bad request gets 400 with ``{"error": {"message", "type"}}``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")


def _chunk_layout(kv_bytes_per_token: int) -> tuple[int, int]:
    """(num_layers, head_size) of a uint8 KV of ``kv_bytes_per_token`` bytes a token: K and V
    of one layer, one head (LMCache's KV_2LTD chunk: [2, layers, tokens, head_size])."""
    if kv_bytes_per_token < 2 or kv_bytes_per_token % 2:
        raise ValueError(f"kv_bytes_per_token must be an even number >= 2 (got {kv_bytes_per_token})")
    return 1, kv_bytes_per_token // 2


class Sidecar:
    """One LMCache engine (CPU backend + Mooncake remote + controller) and its byte connector."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.standalone.manager import StandaloneLMCacheManager

        self.torch = torch
        self.chunk = int(args.chunk_size)
        self.bpt = int(args.kv_bytes_per_token)
        layers, head = _chunk_layout(self.bpt)
        self.layers, self.head = layers, head
        extra: dict[str, Any] | None = None
        remote = None
        if args.mooncake_master:
            remote = f"mooncakestore://{args.mooncake_master}"
            extra = {
                "local_hostname": f"{args.host}:{args.mooncake_port}",
                "metadata_server": args.mooncake_metadata,
                "protocol": "tcp",
                "master_server_address": args.mooncake_master,
                # Mooncake 0.3.13's dict setup reads master_server_addr; LMCache 0.5.6 forwards
                # master_server_address as is (then the client dials the default
                # 127.0.0.1:50051 and fails): the mooncake_ prefix forwards the right key
                "mooncake_master_server_addr": args.mooncake_master,
                "global_segment_size": int(args.mooncake_segment_bytes),
                "local_buffer_size": int(args.mooncake_buffer_bytes),
            }
        ctl = {}
        if args.controller:
            pull, reply = args.controller.split(",")
            ctl = {
                "enable_controller": True,
                "controller_pull_url": pull,
                "controller_reply_url": reply,
                "lmcache_worker_ports": [int(args.worker_port)],
            }
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=self.chunk,
            local_cpu=True,
            max_local_cpu_size=float(args.cpu_gb),
            remote_url=remote,
            remote_serde="naive",
            lmcache_instance_id=args.instance_id,
            extra_config=extra,
            **ctl,
        )
        shape = (layers, 2, self.chunk, 1, head)
        md = LMCacheMetadata(
            model_name=args.model_name,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.uint8,
            kv_shape=shape,
            use_mla=False,
            role="worker",
        )
        sidecar = self

        class BytesConnector(MockGPUConnector):
            """Copies between LMCache's chunk tensors ([2, L, T, D]) and the request's buffer."""

            def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
                buf = kwargs["kvbuf"]
                for m, s, e in zip(memory_objs, starts, ends, strict=True):
                    m.tensor[:, :, : e - s, :].copy_(buf[:, :, s:e, :])

            def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
                buf = kwargs["kvbuf"]
                for m, s, e in zip(memory_objs, starts, ends, strict=True):
                    buf[:, :, s:e, :].copy_(m.tensor[:, :, : e - s, :])

            def get_shape(self, num_tokens=None):
                n = sidecar.chunk if num_tokens is None else num_tokens
                return torch.Size([layers, 2, n, 1, head])

        self.kv_caches = {"layer.0": torch.zeros(shape, dtype=torch.uint8)}
        self.manager = StandaloneLMCacheManager(
            config=cfg,
            metadata=md,
            gpu_connector=BytesConnector(shape),
            broadcast_fn=mock_up_broadcast_fn,
            broadcast_object_fn=mock_up_broadcast_object_fn,
            connector=self,
        )
        self.manager.post_init()
        self.manager.start_services()
        self.engine = self.manager.lmcache_engine
        self.lock = threading.Lock()
        self.instance_id = args.instance_id

    # ---- the byte layout: [tokens * bpt] bytes <-> [2, L, T, D] uint8 ----

    def _to_chunks(self, raw: bytes, n: int):
        t = self.torch.frombuffer(bytearray(raw), dtype=self.torch.uint8)
        return t.view(n, 2, self.layers, self.head).permute(1, 2, 0, 3).contiguous()

    def _to_bytes(self, buf, n: int) -> bytes:
        return buf[:, :, :n, :].permute(2, 0, 1, 3).contiguous().numpy().tobytes()

    def store(self, tokens: list[int], raw: bytes) -> int:
        n = len(tokens) // self.chunk * self.chunk
        if len(raw) != len(tokens) * self.bpt:
            raise ValueError(f"kv is {len(raw)} bytes; {len(tokens)} tokens need {len(tokens) * self.bpt}")
        if n == 0:
            return 0
        buf = self._to_chunks(raw[: n * self.bpt], n)
        with self.lock:
            self.engine.store(tokens[:n], kvbuf=buf)
        return n

    def lookup(self, tokens: list[int]) -> int:
        with self.lock:
            return int(self.engine.lookup(tokens))

    def retrieve(self, tokens: list[int]) -> tuple[int, bytes]:
        n = len(tokens) // self.chunk * self.chunk
        if n == 0:
            return 0, b""
        buf = self.torch.zeros((2, self.layers, n, self.head), dtype=self.torch.uint8)
        with self.lock:
            mask = self.engine.retrieve(tokens[:n], kvbuf=buf)
        hit = int(mask.sum().item()) if mask is not None else 0
        return hit, self._to_bytes(buf, hit)

    def close(self) -> None:
        try:
            self.manager.stop_services()
        except Exception:  # noqa: BLE001 - shutting down
            pass


def _tokens(body: dict) -> list[int]:
    t = body.get("tokens")
    if not isinstance(t, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in t
    ):
        raise ValueError("tokens: must be a list of non-negative integers")
    return t


def make_handler(side: Sidecar):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *a):  # quiet: the worker logs what matters
            pass

        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"ok": True, "instance": side.instance_id, "chunk_size": side.chunk})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

        def do_POST(self):
            try:
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("body must be a JSON object")
                if self.path == "/store":
                    raw = base64.b64decode(body.get("kv_b64") or "", validate=True)
                    self._send(200, {"stored_tokens": side.store(_tokens(body), raw)})
                elif self.path == "/lookup":
                    self._send(200, {"hit_tokens": side.lookup(_tokens(body))})
                elif self.path == "/retrieve":
                    hit, raw = side.retrieve(_tokens(body))
                    self._send(200, {"hit_tokens": hit, "kv_b64": base64.b64encode(raw).decode()})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
            except (ValueError, json.JSONDecodeError) as e:
                self._send(400, {"error": {"message": str(e), "type": "invalid_request_error"}})

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stack.kv_tier.lmcache_engine_sidecar")
    ap.add_argument("--instance-id", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True, help="this sidecar's HTTP port")
    ap.add_argument("--model-name", default="emulated")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--kv-bytes-per-token", type=int, default=16)
    ap.add_argument("--cpu-gb", type=float, default=0.25, help="LMCache's local CPU tier")
    ap.add_argument("--controller", default=None, help="PULL,REPLY addresses of lmcache_controller")
    ap.add_argument("--worker-port", type=int, default=None, help="this engine's controller worker port")
    ap.add_argument(
        "--mooncake-master", default=None, help="host:port: the Mooncake store as LMCache's remote"
    )
    ap.add_argument("--mooncake-port", type=int, default=None, help="this client's Mooncake port")
    ap.add_argument("--mooncake-metadata", default="P2PHANDSHAKE")
    ap.add_argument("--mooncake-segment-bytes", type=int, default=64 << 20)
    ap.add_argument("--mooncake-buffer-bytes", type=int, default=32 << 20)
    args = ap.parse_args(argv)
    if args.controller and args.worker_port is None:
        ap.error("--controller needs --worker-port")
    if args.mooncake_master and args.mooncake_port is None:
        ap.error("--mooncake-master needs --mooncake-port")
    if os.environ.get("PYTHONHASHSEED") != "0":
        # LMCache hashes chunks with Python's hash(): every engine and the controller must agree
        print("lmcache sidecar: PYTHONHASHSEED must be 0 (LMCache's chunk hashes)", file=sys.stderr)
        return 2
    side = Sidecar(args)
    srv = ThreadingHTTPServer((args.host, args.port), make_handler(side))
    print(f"lmcache sidecar {args.instance_id} ready on http://{args.host}:{args.port}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
        side.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
