"""``smetric calibrate``: measure a running SGLang engine and write the calibration file that
``--hardware FILE`` (simulator, emulator, router) takes. The work is in :mod:`stack.calibrate`."""

from __future__ import annotations

import argparse
from pathlib import Path

EPILOG = """\
what it measures
  prefill   a grid of new tokens n (geometric from --min-new to --max-new, default the target's
            chunked-prefill budget) x cached prefix c (0, then --cached-levels-1 lengths up to
            --max-context - n). A point with a prefix first sends the prefix alone (one output
            token) so the engine caches it, then prefix + n fresh tokens; each repeat extends
            the same warm prefix with other fresh tokens. Prompts are random token ids; token
            counts are the engine's own (meta_info prompt_tokens / cached_tokens).
  decode    --decode-contexts prompt lengths x --decode-steps output lengths, streamed; the
            seconds per step between the first and the last token.
  every request runs alone (one at a time), so no measurement is queueing; the target must
  be otherwise idle (with --enable-metrics a measurement that queued is counted and warned).

how it times
  metrics   native /generate's meta_info with SGLang's --enable-metrics:
            prefill_finished_time - forward_entry_time, the engine's own forward time
  client    on this side, where the target has no metrics. Against a worker's /generate
            each one-token request is streamed and timed from the answer's headers to its
            first token: SGLang sends the headers once it has parsed the body, so the upload
            and parse of the prompt's ids (host overhead that grows with the prompt) are left
            out, and the engine's queue, forward and first write are in. Through a router or
            on /v1/completions: the whole wall clock (as `wall`)
  wall      the whole wall clock of each one-token request (host overhead included; most of
            it lands in c_fwd): what a client's TTFT is
  --timing auto takes metrics when the target has them. A target with neither forward timings
  nor token counts (no /generate meta_info, no cached tokens in /v1/completions' usage) is
  refused, naming the flag to add (--enable-metrics, or --enable-cache-report).

emulated targets
  `smetric worker --emulate` runs modelled time at --time-factor x wall. Its /server_info
  reports the factor and calibrate divides client-side wall times by it; its metrics
  (--enable-metrics) are already modelled seconds. Behind a router the factor is not reported:
  pass --time-factor.

the fit
  cost(n, L) = c_linear*n + c_attn*n*(L - n/2) + c_fwd per forward: non-negative least squares
  (scipy) of the relative error on one figure per design point (--reduce: the median of its
  repeats, or for wall clocks, which a busy host only lengthens, the fastest); decode step(1, C) = d_fwd +
  d_ctx*C the same way (d_experts = 0: batch 1 cannot separate it). Every --holdout-every-th
  design point is held out of the fit and scored: the MAPE printed, in the file and the plot.
  --prefix-attention: an engine whose attention kernel runs a query for every context
  position, cached or not (SGLang's torch_native backend, CPU builds), spends about
  c_prefix * p^2/2 more on a prefill with p tokens cached. `yes` fits that fourth term, `no`
  never does, `auto` (default) takes it only when it cuts the fitted points' own error by
  1.5x or more (held-out points take no part in the choice). GPU kernels skip the cached
  queries: c_prefix is 0 there and the file leaves it out.
  Keys a sweep cannot measure (KV bytes per token, NIC, GPUs per server, expert share) come
  from --base.

the PD hand-off (--handoff ROUTER)
  through a router (ours) in front of a PD pool, one request at a time: fresh prompts of
  --handoff-levels lengths from --min-new to --handoff-max, streamed one-token /generate, each
  timed from its send to its first token (/ --time-factor for an emulated pool). What the
  calibration's prefill cost(L, L) does not explain is the hand-off: the decode worker's
  bootstrap, the KV transfer, its first forward, the HTTP hops. Fitted as a fixed part
  (handoff.bootstrap_s) plus a part per prompt token (written as handoff.transfer_gbps at the
  calibration's KV bytes per token), fastest of --repeats per length, every --holdout-every-th
  length held out; the held-out error of the whole first token is printed and in the file.
  With --target (or --from) the prefill is priced by that fit; with --handoff alone, by
  --base (the pool's calibration file), which is written back out with the hand-off added.
  The simulator adds handoff seconds to every PD first token; the emulator's decode worker
  waits all of it but the HTTP hops (which are real there).

the PD hand-off from a recording (--handoff-from REC)
  the router's own traffic instead of a sweep: a recording (router.record) made with
  router.cost_model observe or learn carries, per request, the router's TTFT, its wait in the
  router's queue and the prefill worker's own queue and forward seconds. The rest of each
  streamed PD first token is the path beyond the prefill; it is fitted as above over
  --handoff-levels prompt-length bins, each bin's median (the typical cost under that
  traffic, not the least), every --holdout-every-th bin held out.

--from FILE fits recorded per-request prefill timings instead (CSV with a header, or JSON
lines: new_tokens or context, cached_tokens, forward_s, optional queue_s, alone), e.g. the
router's export (GET /admin/cost_model/observations); rows with alone=false are left out.
One row in each --holdout-every is held out, its place in the block varying from block to
block, so traffic that cycles through a few prompt sizes is not held out at one size only.

examples
  smetric worker --emulate --mode colocated --hardware h200 --time-factor 1.0 --port 30000 &
  smetric calibrate --target http://127.0.0.1:30000 --out my-pool.yaml
  smetric sim --hardware my-pool.yaml ...        # the simulator on the measured model
  smetric calibrate --from observations.jsonl --out learned.yaml
  smetric calibrate --handoff http://127.0.0.1:8000 --base my-pool.yaml --out my-pool-pd.yaml
  smetric calibrate --handoff-from recordings/ --base my-pool.yaml --out my-pool-pd.yaml
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--target", metavar="URL", help="a running SGLang worker (real or emulated) or our router"
    )
    src.add_argument(
        "--from", dest="from_file", metavar="FILE", help="fit recorded observations (CSV or JSONL) instead"
    )
    p.add_argument(
        "--handoff",
        metavar="ROUTER",
        default=None,
        help="also measure the PD hand-off through this router (alone: on --base; see below)",
    )
    p.add_argument(
        "--handoff-from",
        metavar="REC",
        default=None,
        help="fit the PD hand-off from a recording of the router's traffic (router.record: a "
        "record-*.jsonl file or their directory) instead of measuring it (see below)",
    )
    p.add_argument(
        "--out", required=True, type=Path, help="calibration YAML to write (--hardware FILE takes it)"
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="predicted-vs-measured PNG (default: --out with .png; 'none': no plot)",
    )
    p.add_argument("--name", default=None, help="calibration name (default: the --out file's stem)")
    p.add_argument(
        "--base",
        default="h20",
        help="calibration for the keys a sweep does not measure (h20, h200 or a YAML)",
    )
    g = p.add_argument_group("timing")
    g.add_argument(
        "--timing",
        choices=["auto", "metrics", "client", "wall"],
        default="auto",
        help="how prefills are timed (see 'timing' below)",
    )
    g.add_argument(
        "--reduce",
        choices=["auto", "median", "min"],
        default="auto",
        help="a design point's repeats to one figure (auto: min for wall clocks, else median)",
    )
    g.add_argument(
        "--time-factor",
        type=float,
        default=None,
        help="wall seconds per modelled second of an emulated target (default: its /server_info; 1 otherwise)",
    )
    g.add_argument("--request-timeout-s", type=float, default=300.0, help="bound of one request")
    d = p.add_argument_group("design")
    d.add_argument("--max-context", type=int, default=32768, help="longest prompt (capped by the target's)")
    d.add_argument(
        "--max-new", type=int, default=None, help="most new tokens of a prefill (default: chunk budget)"
    )
    d.add_argument("--min-new", type=int, default=128, help="fewest new tokens of a prefill")
    d.add_argument("--new-levels", type=int, default=5, help="new-token lengths")
    d.add_argument("--cached-levels", type=int, default=4, help="cached-prefix lengths, 0 included")
    d.add_argument(
        "--decode-contexts", type=int, default=3, help="decode prompt lengths (0: no decode sweep)"
    )
    d.add_argument("--decode-steps", default="8,32", help="decode output lengths, comma-separated")
    d.add_argument(
        "--repeats", type=int, default=3, help="measurements per design point (their median is fitted)"
    )
    d.add_argument(
        "--holdout-every",
        type=int,
        default=5,
        help="every k-th design point is held out and scored (--from: one row in each k)",
    )
    d.add_argument("--seed", type=int, default=0, help="random token ids and run order")
    d.add_argument(
        "--prefix-attention",
        choices=("auto", "yes", "no"),
        default="auto",
        help="fit the recomputed-prefix term c_prefix (see 'the fit' below; default auto)",
    )
    d.add_argument(
        "--token-ids",
        default="100:1000",
        help="range lo:hi of the random token ids (inside the model's vocabulary)",
    )
    d.add_argument(
        "--handoff-levels",
        type=int,
        default=6,
        help="--handoff: prompt lengths; --handoff-from: prompt-length bins",
    )
    d.add_argument("--handoff-max", type=int, default=8192, help="--handoff: the longest prompt")
    d.add_argument(
        "--handoff-between-forwards",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--handoff/--handoff-from: write handoff.between_forwards: the pool's prefill workers "
        "hand a finished prefill over only between forwards, as SGLang's PD prefill loop does "
        "(default); --no-handoff-between-forwards for a pool that hands over at once (the "
        "emulator on a calibration without it)",
    )
    d.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="--from: the engine's chunked-prefill budget (default: --base's)",
    )


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what}: comma-separated integers, not {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from stack.calibrate.run import Options, calibrate_from, calibrate_handoff, calibrate_target
    from stack.calibrate.target import TargetError
    from stack.cli import CLIError

    if not (args.target or args.from_file or args.handoff or args.handoff_from):
        raise CLIError("calibrate: give --target URL, --from FILE, --handoff ROUTER or --handoff-from REC")
    if args.handoff and args.handoff_from:
        raise CLIError("calibrate: --handoff measures the hand-off, --handoff-from fits it: give one")

    lo_hi = _ints(args.token_ids.replace(":", ","), "--token-ids")
    if len(lo_hi) != 2 or not 0 <= lo_hi[0] < lo_hi[1]:
        raise ValueError("--token-ids: lo:hi with 0 <= lo < hi")
    if args.plot is None:
        plot = args.out.with_suffix(".png")
    else:
        plot = None if str(args.plot).lower() == "none" else args.plot
    o = Options(
        out=args.out,
        plot=plot,
        base=args.base,
        name=args.name,
        timing=args.timing,
        reduce=args.reduce,
        time_factor=args.time_factor,
        max_context=args.max_context,
        max_new=args.max_new,
        min_new=args.min_new,
        new_levels=args.new_levels,
        cached_levels=args.cached_levels,
        decode_contexts=args.decode_contexts,
        decode_steps=_ints(args.decode_steps, "--decode-steps"),
        repeats=args.repeats,
        holdout_every=args.holdout_every,
        seed=args.seed,
        id_range=(lo_hi[0], lo_hi[1]),
        request_timeout_s=args.request_timeout_s,
        chunk_tokens=args.chunk_tokens,
        prefix_attention=args.prefix_attention,
        handoff_url=args.handoff,
        handoff_levels=args.handoff_levels,
        handoff_max=args.handoff_max,
        handoff_from=args.handoff_from,
        between_forwards=args.handoff_between_forwards,
    )
    console = Console()
    if args.from_file:
        return calibrate_from(args.from_file, o, console)
    if not args.target:
        return calibrate_handoff(o, console)
    try:
        return calibrate_target(args.target, o, console)
    except TargetError as e:
        raise CLIError(str(e)) from None
