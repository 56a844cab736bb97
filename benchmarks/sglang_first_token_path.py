"""Where a real PD pair's time to first token goes beyond the prefill: chat against /generate.

    python benchmarks/sglang_first_token_path.py --calibration FILE [--requests 50] [--out DIR]

Starts the pair of `benchmarks/sglang_fidelity.py` (1 prefill + 1 decode SGLang CPU worker,
`mooncake_tcp`, one compute thread each pinned to CPU 0 and 1, our router in front with
`cost_model: observe`), warms it up, then sends one request at a time, alternating a streamed
chat completion of text and a streamed `/generate` of as many random token ids, each with one
output token. For each it reads the prefill worker's own queue and forward seconds (the
router's observations) and prints, per API, medians and p10/p90 of:

- the client's time to the answer's first chunk;
- that time less the prefill worker's queue and forward: the path beyond the prefill (the
  hand-off, the HTTP hops, both workers' request handling);
- that time less the calibration's price of the prefill (what `smetric calibrate --handoff`
  fits, from the fastest repeat);
- the forward itself.

Then a few chat answers of `--tokens` tokens with every chunk timed: how long the first
visible text trails the first chunk (the detokenizer holds back incomplete UTF-8).
docs/research/simulator.md ("Against a real engine") has a run's figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_fidelity as fid  # noqa: E402

from stack.core.cost_model import load_hardware  # noqa: E402
from stack.stats import percentile  # noqa: E402

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "green", "light")


def first_chunk(url: str, path: str, body: dict) -> float:
    """Seconds from sending ``body`` to the first event of its streamed answer."""
    t0 = time.monotonic()
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.monotonic() - t0
    raise RuntimeError(f"{path}: no streamed event")


def chunk_times(url: str, body: dict) -> tuple[float, float | None]:
    """(first chunk, first chunk with visible text) of a streamed chat answer, seconds."""
    t0 = time.monotonic()
    first = text = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            for ch in json.loads(line[5:]).get("choices") or ():
                now = time.monotonic() - t0
                first = now if first is None else first
                if text is None and (ch.get("delta") or {}).get("content"):
                    text = now
    if first is None:
        raise RuntimeError("chat: no answer chunk")
    return first, text


def _last_observation(url: str, seen: int) -> dict | None:
    for _ in range(20):  # the router records the prefill half just after the answer
        obs = fid.observations(url)[seen:]
        if obs:
            return obs[-1]
        time.sleep(0.05)
    return None


def _chat_body(rng: random.Random, words: int, max_tokens: int) -> dict:
    text = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(words))
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


def measure(url: str, cost, n: int, warmup: int, seed: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    rows: dict[str, list[dict]] = {"chat": [], "generate": []}
    for i in range(warmup + n):
        seen = len(fid.observations(url))
        client = first_chunk(url, "/v1/chat/completions", _chat_body(rng, rng.choice([60, 120, 180]), 1))
        o = _last_observation(url, seen)
        if o is None:
            continue
        L = int(o["new_tokens"] + o["cached_tokens"])
        ids = [rng.randrange(10, 500) for _ in range(L)]
        gen = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        seen2 = len(fid.observations(url))
        client_g = first_chunk(url, "/generate", gen)
        o2 = _last_observation(url, seen2)
        if i < warmup or o2 is None:
            continue
        for api, c, ob in (("chat", client, o), ("generate", client_g, o2)):
            engine = ob["forward_s"] + ob.get("queue_s", 0.0)
            rows[api].append(
                {
                    "prompt_tokens": L,
                    "client_s": c,
                    "forward_s": ob["forward_s"],
                    "beyond_prefill_s": c - engine,
                    "beyond_model_s": c - cost.cost(L, L),
                }
            )
    return rows


def summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for k in ("prompt_tokens", "client_s", "forward_s", "beyond_prefill_s", "beyond_model_s"):
        xs = sorted(r[k] for r in rows)
        out[k] = {"p10": percentile(xs, 0.1), "p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--calibration", type=Path, required=True, help="the pair's calibration (prices the prefill)"
    )
    p.add_argument("--requests", type=int, default=50, help="measured requests per API (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="pairs sent first and not counted (default 10)")
    p.add_argument("--tokens", type=int, default=12, help="output tokens of the hold-back probe (default 12)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--out", type=Path, default=Path("first-token-path"), help="output directory")
    a = p.parse_args(argv)
    py, model = fid.prepare(a.out, "small")
    cost = load_hardware(str(a.calibration)).cost
    with fid.pd_stack(py, model, a.out, 8192, a.calibration, 30.0) as (url, _workers):
        rows = measure(url, cost, a.requests, a.warmup, a.seed)
        rng = random.Random(a.seed + 1)
        held = [chunk_times(url, _chat_body(rng, w, a.tokens)) for w in (60, 120, 180, 60, 120, 180)]
    res = {api: summary(r) for api, r in rows.items() if r}
    res["hold_back"] = [{"first_chunk_s": f, "first_text_s": t} for f, t in held]
    for api in ("chat", "generate"):
        if api in res:
            s = res[api]
            print(
                f"{api}: n {len(rows[api])}, prompt median {s['prompt_tokens']['p50']:.0f} tokens; "
                + "; ".join(
                    f"{k} p50 {1000 * s[k]['p50']:.0f} ms (p10-p90 {1000 * s[k]['p10']:.0f}-{1000 * s[k]['p90']:.0f})"
                    for k in ("client_s", "forward_s", "beyond_prefill_s", "beyond_model_s")
                )
            )
    for h in res["hold_back"]:
        t = h["first_text_s"]
        print(
            f"hold-back: first chunk {h['first_chunk_s']:.3f} s, first text {'-' if t is None else f'{t:.3f} s'}"
        )
    (a.out / "first_token_path.json").write_text(json.dumps({"rows": rows, **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
