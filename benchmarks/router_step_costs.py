"""What each step of the router's own work costs, per request, in process (no HTTP).

The profile beside `benchmarks/router_overhead.py`: that script measures whole requests
against the Rust routers and a Python floor; this one times the steps our router adds on
top of the floor, on the same two bodies (a 4 KB first turn the router has not seen, and a
400 KB agent follow-up whose history it has tokenized before), with the tiny test tokenizer.

    python benchmarks/router_step_costs.py [--n 200] [--workers 32]

Steps: JSON parse; chat-template render; tokenizing (the HF tokenizer alone, then the
router's segment-cached encode around it); the whole feature derivation (render, encode,
turn, est_hit, block hashes with the hash memo); the prefix-index lookup and the routing
history update; the global tier's written-index lookup and update; one cluster view of
``--workers`` workers; SMetric's decision on it. Each figure is the mean wall time over
``--n`` calls on one thread (CPU-bound, so about its CPU time).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from router_overhead import large_bodies, small_bodies  # noqa: E402

from stack.kv_tier.global_index import WrittenIndex  # noqa: E402
from stack.kv_tier.index import PrefixIndex  # noqa: E402
from stack.models.tiny import build_tiny_model  # noqa: E402
from stack.pool import Worker  # noqa: E402
from stack.prefill_router.cost_model import load_hardware  # noqa: E402
from stack.prefill_router.features import FeatureExtractor  # noqa: E402
from stack.prefill_router.policies import PolicyContext, make_policy  # noqa: E402
from stack.prefill_router.types import SLO, Request  # noqa: E402
from stack.prefill_router.view import build_view  # noqa: E402


def per_call(fn, n: int) -> float:
    """Mean milliseconds of ``fn(i)`` over ``i`` in range(n)."""
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="calls per step")
    ap.add_argument("--workers", type=int, default=32, help="prefill workers in the view")
    a = ap.parse_args()
    n = a.n
    model = build_tiny_model(Path(tempfile.mkdtemp(prefix="smetric-steps-")) / "model")
    rows: list[tuple[str, str, float]] = []

    def row(body: str, step: str, ms: float) -> None:
        rows.append((body, step, ms))

    # -- a 4 KB first turn, new to the router -------------------------------------------
    raw_s = small_bodies(2 * n + 1, seed=7)
    small = [orjson.loads(b) for b in raw_s]
    fx = FeatureExtractor(model, 64)
    fx.context_length = 1_000_000
    fx.chat(small[0])  # template compiled, caches primed
    tok = fx.tok
    texts = [tok.render(b["messages"], None, True, None) for b in small]
    row("4 KB", "JSON parse (orjson)", per_call(lambda i: orjson.loads(raw_s[i]), n))
    row(
        "4 KB",
        "chat-template render",
        per_call(lambda i: tok.render(small[i]["messages"], None, True, None), n),
    )
    row("4 KB", "HF tokenizer alone", per_call(lambda i: tok.hf.encode_batch_fast([texts[i]]), n))
    row("4 KB", "features, all of them", per_call(lambda i: fx.chat(small[n + i]), n))

    # -- a 400 KB follow-up on a history the router has seen ------------------------------
    raw_l = large_bodies(n + 5, seed=7)
    large = [orjson.loads(b) for b in raw_l]
    for b in large[:5]:
        fx.chat(b)
    large = large[5:]
    text = tok.render(large[0]["messages"], None, True, None)
    tail = large[0]["messages"][-1]["content"]
    row("400 KB", "JSON parse (orjson)", per_call(lambda i: orjson.loads(raw_l[5 + i]), n))
    row(
        "400 KB",
        "chat-template render",
        per_call(lambda i: tok.render(large[i]["messages"], None, True, None), n),
    )
    row(
        "400 KB",
        "HF tokenizer on the new turn alone",
        per_call(lambda i: tok.hf.encode_batch_fast([tail]), n),
    )
    row("400 KB", "encode, history cached (segments, lookups)", per_call(lambda i: tok.encode(text), n))
    row("400 KB", "features, all of them", per_call(lambda i: fx.chat(large[i]), n))

    f = fx.chat(large[0])
    idx = PrefixIndex(64, approx_capacity_blocks=1_000_000)
    for w in range(a.workers):
        idx.add_worker(w, False)
    idx.record_routed(3, f.hashes)
    idx.record_routed(5, f.hashes[:100])
    written = WrittenIndex()
    written.record_written(f.hashes)
    row("400 KB", f"prefix-index lookup ({len(f.hashes)} blocks)", per_call(lambda i: idx.hits(f.hashes), n))
    row("400 KB", "routing-history update", per_call(lambda i: idx.record_routed(3, f.hashes), n))
    row("400 KB", "global tier: written-index lookup", per_call(lambda i: written.hit_sync(f.hashes), n))
    row(
        "400 KB", "global tier: written-index update", per_call(lambda i: written.record_written(f.hashes), n)
    )

    ws = [Worker(wid=i, role="prefill", url=f"http://127.0.0.1:{9000 + i}") for i in range(a.workers)]
    hits = idx.hits(f.hashes)
    now = time.monotonic()

    def view(_i: int):
        return build_view(
            now,
            ws,
            hits,
            len(f.hashes),
            prompt_tokens=f.prompt_tokens,
            block_size=64,
            fetch_tokens_per_s=2e6,
            sec_per_token=2e-5,
        )

    v = view(0)
    pol = make_policy("smetric", PolicyContext(load_hardware("h20").cost, SLO()))
    req = Request(f.prompt_tokens, f.turn, f.est_hit)
    row("any", f"cluster view of {a.workers} workers", per_call(view, n))
    row("any", "SMetric decision", per_call(lambda i: pol.choose(req, v), n))

    print(f"router steps, mean ms per call over {n} calls (tiny test tokenizer, {a.workers} workers)")
    print(f"{'body':8s} {'step':46s} {'ms':>8s}")
    for body, step, ms in rows:
        print(f"{body:8s} {step:46s} {ms:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
