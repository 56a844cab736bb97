"""The live link backlog: each worker's global-tier link as one FIFO of fetches, kept the same
way by the simulator (stack/sim/instance.py, Link), the router's accounting of its bookings
(stack/pool/worker.py, Worker.fetch_booked) and the emulated worker (stack/worker/global_tier.py,
GlobalTier.link_wait); the router's view carries it, and the dispatch rules that read it
(readiness, bypass, affinity) act on it live as they do in the simulator."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from stack.core.types import SLO
from stack.dispatch import DispatchSpec
from stack.policies import PolicyContext, make_policy
from stack.pool import WorkerRegistry
from stack.prefill_router.routing import PrefillRouter
from stack.prefill_router.view import build_view
from stack.sim.instance import Link
from stack.worker.global_tier import GlobalTier
from tests.unit.test_bypass import (
    BS,
    BW,
    COST,
    _bypasses,
    _Cache,
    _feats,
    _Global,
    _Index,
    _Link,
    _live_queue,
    _SimInstance,
)

pytestmark = pytest.mark.timeout(30)


def _transfers(n: int, seed: int):
    """``n`` transfers (when, seconds) in time order, with idle gaps and bursts."""
    rng = random.Random(seed)
    t = 0.0
    for _ in range(n):
        t += rng.choice([0.0, 0.0, rng.uniform(0, 0.5), rng.uniform(0, 5)])
        yield t, rng.uniform(0.01, 2.0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_router_emulator_and_simulator_keep_one_fifo_per_link(seed):
    bw = 1_000.0
    sim = Link(bw)
    reg = WorkerRegistry(eject_cooldown_s=0)
    w = reg.add("prefill", "http://127.0.0.1:21000")
    emu = GlobalTier(SimpleNamespace(link_file=None), None, None)
    queued = False
    for t, sec in _transfers(200, seed):
        before = w.link_backlog(t)
        assert before == pytest.approx(max(0.0, sim.free_at - t), abs=1e-9)
        queued |= before > 0
        end = sim.fetch(t, round(sec * bw))
        assert w.fetch_booked(t, round(sec * bw) / bw) == pytest.approx(end, abs=1e-9)
        assert t + emu.link_wait(t, round(sec * bw) / bw) == pytest.approx(end, abs=1e-9)
    assert queued  # transfers did queue behind each other
    assert w.link_backlog(sim.free_at + 1) == 0.0


def _router(g_blocks: int, local: dict[int, int], clock):
    reg = WorkerRegistry(eject_cooldown_s=0)
    ws = [reg.add("prefill", f"http://127.0.0.1:{21000 + i}") for i in range(2)]
    ctx = PolicyContext(COST, SLO(), BS)
    r = PrefillRouter(
        reg, _Index(local), _Global(g_blocks), make_policy("smetric-global", ctx), COST, BS, BW, clock=clock
    )
    return r, reg, ws


def test_a_routed_request_queues_its_fetch_on_its_workers_link():
    """A request whose prefix the global tier holds beyond the chosen worker's local hit
    books that fetch on the worker's link; the next view carries the backlog, and it drains
    with the pool's clock."""
    now = [100.0]
    r, reg, ws = _router(2_000, {}, lambda: now[0])
    L = 2_000 * BS + 1
    f = _feats("a", L)
    f.hashes = list(range(2_000))
    routed = asyncio.run(r.route(f, set(), set(), False))
    w = reg.workers[routed.booking.prefill.wid]
    fetch_s = 2_000 * BS / BW
    assert w.link_backlog(now[0]) == pytest.approx(fetch_s)
    # a second request to the same worker queues behind the first fetch
    w.fetch_booked(now[0], fetch_s)
    assert w.link_backlog(now[0]) == pytest.approx(2 * fetch_s)
    v = build_view(
        0.0, ws, {}, 0, prompt_tokens=L, block_size=BS, fetch_tokens_per_s=BW,
        sec_per_token=COST.c_linear, link_now=now[0] + fetch_s / 2,
    )  # fmt: skip
    assert v.instances[w.wid].fetch_backlog_s == pytest.approx(1.5 * fetch_s)
    assert v.instances[1 - w.wid].fetch_backlog_s == 0.0
    now[0] += 10 * fetch_s
    assert w.link_backlog(now[0]) == 0.0


def test_a_request_with_nothing_to_fetch_books_no_transfer():
    r, reg, ws = _router(2_000, {0: 2_000, 1: 2_000}, lambda: 5.0)
    f = _feats("b", 2_000 * BS + 1)
    f.hashes = list(range(2_000))
    asyncio.run(r.route(f, set(), set(), False))
    assert all(w.link_backlog(5.0) == 0.0 for w in ws)


def test_live_readiness_holds_behind_a_link_backlog_and_lead_share_lets_it_go():
    """One idle worker with 20 s of fetches booked on its link: under ``slack:T=4`` it is not
    ready (the estimated start is the backlog), so a request is held; where the backlog
    counts as lead time (``lead_share=0``) the same worker is ready. As the simulator's
    readiness reads its link (stack/dispatch/readiness.py)."""

    async def go(label: str) -> int:
        q, reg, routing = _live_queue(label, [0], 0, BW)
        w = reg.workers[0]
        w.fetch_booked(q.clock(), 20.0)
        states = q.routing.load_states(q.clock(), [w])
        assert states[0].fetch_backlog_s == pytest.approx(20.0, abs=0.05)
        task = asyncio.create_task(q.route(_feats("r", 64 * BS), set(), set(), False))
        for _ in range(100):
            await asyncio.sleep(0.005)
            if routing.routed:
                break
        depth = q.depth
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return depth

    assert asyncio.run(go("slack:T=4")) == 1
    assert asyncio.run(go("slack:T=4:lead_share=0:slo_k=0.5")) == 0


def _sim_bypass(label: str, local: list[int], backlog: list[float], g: int, L: int) -> bool:
    from stack.sim.queues import RouterQueue

    eng = SimpleNamespace(
        insts=[_SimInstance(_Cache(b), _Link(f)) for b, f in zip(local, backlog)],
        bs=BS,
        glob=_Cache(g),
        fetch_tokens_per_s=BW,
        view=None,
        bypass=DispatchSpec.parse(label).build().bypass,
        cost=COST,
    )
    return RouterQueue.bypass_now(eng, 0.0, tuple(range(L // BS)), L)


def test_router_and_simulator_make_the_same_bypass_decisions_behind_a_backlog():
    """The bypass rule with link backlogs on the workers, the live router's (its bookings)
    against the simulator's (its links' FIFOs): the same decisions, and some only the
    backlog makes."""
    label = "slack:T=4:bypass=1"
    rng = random.Random(23)
    seen = set()
    by_backlog = 0

    async def go():
        nonlocal by_backlog
        for _ in range(120):
            L = rng.choice([4_000, 30_000, 90_000])
            nb = L // BS
            k = rng.randint(1, 4)
            local = [rng.randint(0, nb) if rng.random() < 0.5 else 0 for _ in range(k)]
            g = rng.randint(0, nb)
            backlog = [rng.choice([0.0, rng.uniform(0, 3), rng.uniform(0, 30)]) for _ in range(k)]
            q, reg, _ = _live_queue(label, local, g, BW)
            for w, b in zip(reg.workers.values(), backlog):
                w.link.free_at = q.clock() + b
            live = await _bypasses(q, _feats("x", L))
            assert live == _sim_bypass(label, local, backlog, g, L), (local, backlog, g, L)
            seen.add(live)
            by_backlog += live and not _sim_bypass(label, local, [0.0] * k, g, L)

    asyncio.run(go())
    assert seen == {True, False} and by_backlog > 0


def test_the_emulated_link_queues_concurrent_fetches():
    """Two fetches of 1 s each, started together on one emulated worker: the second waits
    for the first (2 s), as one NIC does; a fetch after the link is idle waits its own."""
    emu = GlobalTier(SimpleNamespace(link_file=None), None, None)
    assert emu.link_wait(10.0, 1.0) == pytest.approx(1.0)
    assert emu.link_wait(10.0, 1.0) == pytest.approx(2.0)
    assert emu.link_wait(13.0, 1.0) == pytest.approx(1.0)


def test_workers_on_one_host_share_its_link_with_router_link_host():
    """``router.link: host``: the workers on one host queue their fetches on one link (the
    simulator's ``--link shared`` groups its instances so); ``worker`` (the default): each
    its own. A bad value is refused."""
    from stack.config import parse_config

    shared = WorkerRegistry(eject_cooldown_s=0, link=parse_config({"router": {"link": "host"}}).router.link)
    a, b = (shared.add("prefill", f"http://10.0.0.1:{p}") for p in (30001, 30002))
    c = shared.add("prefill", "http://10.0.0.2:30001")
    a.fetch_booked(0.0, 2.0)
    assert b.fetch_booked(0.0, 1.0) == pytest.approx(3.0)  # behind a's fetch: one NIC
    assert c.link_backlog(0.0) == 0.0  # another host
    own = WorkerRegistry(eject_cooldown_s=0)
    a, b = (own.add("prefill", f"http://10.0.0.1:{p}") for p in (30001, 30002))
    a.fetch_booked(0.0, 2.0)
    assert b.link_backlog(0.0) == 0.0
    with pytest.raises(ValueError, match="link"):
        WorkerRegistry(link="nic")
    with pytest.raises(ValueError, match="router.link"):
        parse_config({"router": {"link": "nic"}})


def test_emulated_workers_given_one_link_file_share_one_fifo(tmp_path):
    """``--link-file``: two emulated workers (two GlobalTier objects, as in two processes)
    given the same file queue their fetches on one link; a third with its own link does not
    wait for them; the same sequence as the simulator's Link over one shared NIC."""
    path = str(tmp_path / "nic")
    a = GlobalTier(SimpleNamespace(link_file=path), None, None)
    b = GlobalTier(SimpleNamespace(link_file=path), None, None)
    c = GlobalTier(SimpleNamespace(link_file=None), None, None)
    sim = Link(1.0)
    now = 1_000.0
    for tier, sec in ((a, 1.0), (b, 2.0), (a, 0.5)):
        assert now + tier.link_wait(now, sec) == pytest.approx(sim.fetch(now, sec))
    assert c.link_wait(now, 1.0) == pytest.approx(1.0)
    assert a.link_wait(now + 10.0, 1.0) == pytest.approx(1.0)  # the shared link went idle


def test_the_link_file_reaches_the_worker_from_its_flag_and_the_launcher(tmp_path):
    import argparse

    from stack.launch.emulated import worker_argv
    from stack.worker.cli import add_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    path = str(tmp_path / "nic")
    assert settings_from_args(p.parse_args(["--emulate", "--link-file", path])).link_file == path
    assert settings_from_args(p.parse_args(["--emulate"])).link_file is None
    it = {"role": "prefill", "host": "127.0.0.1", "port": 30000, "name": "p0", "bootstrap_port": 30001}
    argv = worker_argv(it, {}, {"emulator": {"link_file": path}}, {"host": "127.0.0.1"})
    assert argv[argv.index("--link-file") + 1] == path
    assert "--link-file" not in worker_argv(it, {}, {}, {"host": "127.0.0.1"})


def test_demo_live_shared_nic_runs_one_nic_emulated_booked_and_simulated():
    """``smetric demo-live --shared-nic``: the stack's config gives the emulated workers one
    link file and the router links per host; the simulator beside it shares one link; more
    prefill workers than one server's GPUs is refused."""
    import argparse
    import os

    import yaml

    from stack.bench.live import simulate_pool
    from stack.bench.main_job_live import stack_config
    from stack.commands.demo_live import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--shared-nic"])
    path = stack_config(args)
    try:
        cfg = yaml.safe_load(open(path).read())
        nic = cfg["launch"]["emulator"]["link_file"]
        assert os.path.exists(nic) and cfg["router"]["link"] == "host"
        os.unlink(nic)
    finally:
        os.unlink(path)
    plain = yaml.safe_load(open(path := stack_config(p.parse_args([]))).read())
    os.unlink(path)
    assert "link_file" not in plain["launch"]["emulator"] and "link" not in (plain.get("router") or {})
    with pytest.raises(ValueError, match="share one NIC"):
        simulate_pool(p.parse_args(["--shared-nic", "--prefill", "9"]), None, "lmetric", "h20", None)
