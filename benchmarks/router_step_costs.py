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

Then the whole request path in process with the upstream stubbed (the router's own Python
per request, without uvicorn's and aiohttp's), and the cold figures: a 60-turn agent session's last prompt on a router that has not seen
it (CPU for all its features, against the HF tokenizer alone), and the CPU per turn of turns
40-59 when a round-robin load balancer spreads the session over 1, 2 or 4 router replicas,
each with its own token cache or sharing segment ids through a real Redis (started here;
``router.redis_token_cache``), and the last prompt on a replica that saw none of the session
while the others shared theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from router_overhead import large_bodies, small_bodies  # noqa: E402

from stack.core.cost_model import load_hardware  # noqa: E402
from stack.core.types import SLO, Request  # noqa: E402
from stack.kv_tier.global_index import WrittenIndex  # noqa: E402
from stack.kv_tier.index import PrefixIndex  # noqa: E402
from stack.models.tiny import build_tiny_model  # noqa: E402
from stack.policies import PolicyContext, make_policy  # noqa: E402
from stack.pool import Worker  # noqa: E402
from stack.prefill_router.features import FeatureExtractor  # noqa: E402
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
    ap.add_argument("--no-cold", dest="cold", action="store_false", help="skip the cold-prompt figures")
    ap.add_argument(
        "--replicas", default="1,2,4", help="router replicas behind a round-robin balancer (cold figures)"
    )
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
    stub = [{"role": m["role"], "content": "x"} for m in large[0]["messages"]]
    row(
        "400 KB",
        f"render, {len(stub)} messages of one character",
        per_call(lambda i: tok.render(stub, None, True, None), n),
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
    row("400 KB", "prefix-index lookup, the plain walk", per_call(lambda i: idx._hits_walk(f.hashes), n))
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
    print()
    print("the router's whole request path in process, upstream stubbed (no HTTP at all), 32 workers,")
    print("best of 3 alternating passes:")
    small_b = small_bodies(n + 10, seed=11)
    large_b = large_bodies(n + 10, seed=11)
    cases = (
        ("round-robin", {"dispatch": {"order": "immediate"}}, "order immediate", small_b),
        ("round-robin", {}, "order slack (default)", small_b),
        ("smetric", {}, "order slack (default)", small_b),
        ("smetric", {"tracing": {"enabled": True}}, "tracing on, not exported", small_b),
        ("smetric", {"feature_attempt_bytes": 0}, "features in the pool", large_b),
        ("smetric", {}, "features inline when warm", large_b),
    )
    best = [float("inf")] * len(cases)
    for _ in range(3):
        for i, (pol, extra, _, bodies) in enumerate(cases):
            best[i] = min(best[i], asyncio.run(in_process(model, pol, extra, bodies)))
    for (pol, _, what, bodies), us in zip(cases, best, strict=True):
        kind = "4 KB" if bodies is small_b else "400 KB"
        print(f"  {pol:12s} {what:28s} {kind:>6s}: {us:7.0f} us of CPU per request")
    full_collection()
    if a.cold:
        cold_prompts(model, a.replicas)
    return 0


async def in_process(model: Path, policy: str, router_extra: dict, bodies: list[bytes]) -> float:
    """CPU microseconds per request of :meth:`InferenceHandler.serve` (parse, features, queue,
    routing, booking, answer, release, metrics) with the upstream hand-off stubbed: the
    router's own Python work, without uvicorn's and aiohttp's."""
    from starlette.requests import Request as HttpRequest

    from stack.config import parse_config
    from stack.decode_router.upstream import Upstream
    from stack.prefill_router.api.inference import InferenceHandler
    from stack.prefill_router.state import RouterState

    router = {"policy": policy} | router_extra
    cfg = parse_config(
        {
            "model": {"name": "tiny", "path": str(model), "page_size": 64, "context_length": 1_000_000},
            "router": router,
            "prefill": [{"url": f"http://127.0.0.1:{9000 + i}", "bootstrap_port": 8998} for i in range(32)],
            "decode": [{"url": "http://127.0.0.1:8999"}],
        }
    )

    async def nothing():
        return
        yield b""

    class Stub:
        async def forward(self, path, raw, body, prefill, decode, on_prefill_done, *args, **kw):
            on_prefill_done()
            return Upstream(200, "application/json", first=b'{"choices":[]}', rest=nothing())

    state = RouterState(cfg)
    state.forwarder = Stub()
    handler = InferenceHandler(state)
    path = "/v1/chat/completions"
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}

    def request(body: bytes) -> HttpRequest:
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # the client stays

        return HttpRequest(dict(scope), receive)

    for b in bodies[:10]:
        await handler.serve(request(b), "chat", path)
    c0 = time.process_time()
    for b in bodies[10:]:
        r = await handler.serve(request(b), "chat", path)
        assert r.status_code == 200, r.body
    us = (time.process_time() - c0) / (len(bodies) - 10) * 1e6
    state.feature_pool.close()
    return us


def full_collection() -> None:
    """What a full collection costs in this process (the router's modules and app loaded,
    its caches filled by the passes above), and after ``gc.freeze()`` as ``smetric router``
    does once started: a full collection is a stall of the event loop."""
    import gc

    from stack.config import parse_config
    from stack.prefill_router.api.app import create_app

    create_app(parse_config({"prefill": [{"url": "http://127.0.0.1:9"}]}))  # FastAPI and the app built
    gc.collect()
    n = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    plain = (time.perf_counter() - t0) * 1e3
    gc.freeze()
    t0 = time.perf_counter()
    gc.collect()
    frozen = (time.perf_counter() - t0) * 1e3
    gc.unfreeze()
    print(f"full collection: {plain:.1f} ms over {n} tracked objects; {frozen:.1f} ms with them frozen")


def agent_session(turns: int, seed: int = 3) -> list[dict]:
    """The chat bodies of one append-only agent session, turn by turn (~8.5k characters a
    turn: a tool result and a short reply)."""
    import random

    from router_overhead import blob

    rng = random.Random(seed)
    msgs = [{"role": "system", "content": "You are a coding agent. " * 40}]
    bodies = []
    for _ in range(turns):
        msgs = msgs + [{"role": "user", "content": blob(rng, 7600)}]
        bodies.append({"model": "tiny", "messages": msgs, "max_tokens": 1})
        msgs = msgs + [{"role": "assistant", "content": blob(rng, 900)}]
    return bodies


def cpu_ms(fn) -> float:
    """CPU milliseconds of ``fn()``, all threads of the process (the tokenizer may use more
    than one)."""
    c0 = time.process_time()
    fn()
    return (time.process_time() - c0) * 1e3


def cold_prompts(model: Path, replicas: str) -> None:
    """A cold agent prompt's cost, and what router replicas pay per turn."""
    bodies = agent_session(60)
    last = bodies[-1]
    fx = FeatureExtractor(model, 64)
    fx.context_length = 1_000_000
    warm = FeatureExtractor(model, 64)
    warm.chat(bodies[0])  # the template compiled: the cold figure is the prompt's own cost
    f = None

    def cold():
        nonlocal f
        f = warm.chat(last)

    ms = cpu_ms(cold)
    tok = fx.tok
    text = tok.render(last["messages"], None, True, None)
    segs = tok.segments(text)
    pieces = [c for sgm in segs for c in tok.chunks(sgm)]
    seg_ms = min(cpu_ms(lambda: tok.hf.encode_batch_fast(pieces, add_special_tokens=False)) for _ in range(3))
    whole_ms = min(cpu_ms(lambda: tok.hf.encode(text, add_special_tokens=False)) for _ in range(3))
    print()
    print(
        f"cold prompt: {f.prompt_tokens} tokens, {len(last['messages'])} messages, {len(text)} characters: "
        f"{ms:.1f} ms of CPU for all its features; the HF tokenizer alone {seg_ms:.1f} ms on the same "
        f"segments, {whole_ms:.1f} ms on the text in one piece"
    )
    from stack.launch.redis_server import RedisServer
    from stack.prefill_router.shared_tokens import SharedTokens

    with RedisServer(Path(tempfile.mkdtemp(prefix="smetric-redis-"))) as redis:
        for r in [int(x) for x in replicas.split(",") if x]:
            own, shared = per_turn(model, bodies, r, redis.url, f"ns{r}")
            print(
                f"{r} replica(s), turns 40-59 ({f.prompt_tokens // 1000}k tokens at the end): "
                f"{own:.1f} ms of CPU per turn, each with its own token cache; "
                f"{shared:.1f} ms sharing segment ids through Redis"
            )
        # a replica that saw none of the session (a restart, a scale-out), the others having
        # shared what they tokenized (the last run above left it in Redis)
        late = FeatureExtractor(model, 64)
        late.context_length = 1_000_000
        late.tok.shared = SharedTokens(redis.url, model / "tokenizer.json", namespace=f"ns{r}")
        late.chat(bodies[0])
        ms = cpu_ms(lambda: late.chat(last))
        late.tok.shared.close()
        print(
            f"the last prompt on a replica that saw none of the session, the segments shared: {ms:.1f} ms of CPU"
        )


def per_turn(model: Path, bodies: list[dict], r: int, redis_url: str, ns: str) -> tuple[float, float]:
    """CPU ms per turn over turns 40-59 when a round-robin load balancer spreads the session
    over ``r`` router replicas (in this process): each with its own token cache, and sharing
    segment ids through Redis, the two measured turn by turn in alternation (the machine's
    drift hits both alike). The background writes are waited for inside the measurement, so
    their CPU counts; Redis's own does not."""
    from stack.prefill_router.shared_tokens import SharedTokens

    fleets = []
    for shared in (False, True):
        fxs = [FeatureExtractor(model, 64) for _ in range(r)]
        for x in fxs:
            x.context_length = 1_000_000
            if shared:
                x.tok.shared = SharedTokens(redis_url, model / "tokenizer.json", namespace=ns)
            x.chat(bodies[0])
        fleets.append(fxs)

    def turn(x: FeatureExtractor, b: dict) -> None:
        x.chat(b)
        if x.tok.shared is not None:
            x.tok.shared.flush()

    costs: list[list[float]] = [[], []]
    for t, b in enumerate(bodies):
        for k, fxs in enumerate(fleets):
            x = fxs[t % r]
            c = cpu_ms(lambda x=x, b=b: turn(x, b))
            if t >= 40:
                costs[k].append(c)
    for x in fleets[1]:
        x.tok.shared.close()
    return sum(costs[0]) / len(costs[0]), sum(costs[1]) / len(costs[1])


if __name__ == "__main__":
    raise SystemExit(main())
