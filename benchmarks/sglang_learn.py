"""Does the router's learned cost model converge against a real SGLang PD pair under load?

    python benchmarks/sglang_learn.py [--size tiny|small] [--requests 240] [--clients 8]

Starts the pair of `benchmarks/sglang_fidelity.py` (1 prefill + 1 decode SGLang CPU worker,
`mooncake_tcp`, `--enable-metrics`, one compute thread each pinned to CPU 0 and 1) with our
router in front, `router.cost_model: learn` (`min_observations` 20, `refit_every` 5, as the
emulator's convergence test), and sends Anthropic Messages requests (a third streamed,
`max_tokens` 2) from `--clients` clients that resend as soon as they are answered, so the
prefill worker is never idle. Prints the answers' status codes and the router's
`GET /admin/cost_model` (trusted or not, and why; rows fitted; observations alone and
shared), and writes the observations to OUT/observations.jsonl.
docs/research/learned-cost.md ("A never-idle real SGLang worker") has a run's figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_fidelity as fid  # noqa: E402

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "green", "light")
#: words per prompt (about 5 tokens each with the test model's tokenizer), cycled
SIZES = (10, 40, 120, 250, 500)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=("tiny", "small"), help="model shape (default small)")
    p.add_argument("--requests", type=int, default=240, help="Messages requests in all (default 240)")
    p.add_argument("--clients", type=int, default=8, help="clients resending at once (default 8)")
    p.add_argument("--out", type=Path, default=Path("sglang-learn"), help="output directory")
    a = p.parse_args(argv)
    py, model = fid.prepare(a.out, a.size)
    base = fid.launch_config

    def learning(*args, **kw) -> dict:
        cfg = base(*args, **kw)
        cfg["router"]["cost_model"] = {"mode": "learn", "min_observations": 20, "refit_every": 5}
        return cfg

    fid.launch_config = learning  # pd_stack builds the pair from it
    context = 8192 if a.size == "small" else 4096
    auth = {"authorization": f"Bearer {fid.ADMIN}"}
    with fid.pd_stack(py, model, a.out, context, None, 30.0) as (url, _workers):

        def one(i: int) -> int:
            rng = random.Random(i)
            text = " ".join(
                rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(SIZES[i % len(SIZES)])
            )
            body = {
                "model": "tiny",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": text}],
                "stream": i % 3 == 0,
            }
            return httpx.post(url + "/v1/messages", json=body, timeout=300).status_code

        t0 = time.monotonic()
        with ThreadPoolExecutor(a.clients) as ex:
            codes = list(ex.map(one, range(a.requests)))
        wall = time.monotonic() - t0
        status = httpx.get(url + "/admin/cost_model", headers=auth, timeout=30).json()
        obs = httpx.get(url + "/admin/cost_model/observations", headers=auth, timeout=30).text
    (a.out / "observations.jsonl").write_text(obs)
    (a.out / "cost_model.json").write_text(json.dumps(status, indent=1))
    print(f"answers: {dict(sorted((c, codes.count(c)) for c in set(codes)))} in {wall:.1f} s")
    print(json.dumps(status, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
