"""An emulated PD pair (1 prefill + 1 decode worker on one calibration file, time factor 1,
KV over HTTP) with our router in front: what the hand-off tests run against."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from stack.config import parse_config
from stack.core.cost_model import Hardware, dump_hardware
from stack.launch.loopback import Procs
from stack.models.tiny import build_tiny_model
from stack.worker.fake import ServerThread


@contextlib.contextmanager
def emulated_pd(d: Path, hw: Hardware, router_hardware: str | None = None) -> Iterator[tuple[str, object]]:
    """Workers on ``hw`` (written to ``d``), the router pricing with ``router_hardware``
    (default: the same file); yields (router URL, decode worker)."""
    cal = d / f"{hw.name}.yaml"
    cal.write_text(dump_hardware(hw))
    common = dict(hardware=str(cal), time_factor=1.0, kv_transport="http", bootstrap_timeout_s=20)
    with Procs(d) as p:
        pre = p.worker("prefill", **common)
        dec = p.worker("decode", **common)
        from stack.prefill_router.service import create_app

        cfg = parse_config(
            {
                "model": {"name": "tiny", "path": str(build_tiny_model(d / "tiny")), "page_size": 64},
                "router": {"hardware": router_hardware or str(cal), "dispatch": {"order": "immediate"}},
                "prefill": [{"url": pre.url, "bootstrap_port": pre.bootstrap_port}],
                "decode": [{"url": dec.url}],
            }
        )
        srv = ServerThread(create_app(cfg)).start()
        try:
            yield srv.url, dec
        finally:
            srv.stop()
