"""The router's shutdown (stack/prefill_router/state.py): each step is bounded, and a step that
hangs or fails is logged by name while the steps after it still run."""

from __future__ import annotations

import asyncio
import logging

from stack.prefill_router import state


def test_a_step_that_hangs_is_skipped_and_named(monkeypatch, caplog):
    monkeypatch.setattr(state, "STOP_STEP_S", 0.05)
    ran: list[str] = []

    async def hangs() -> None:
        await asyncio.sleep(3600)

    async def fails() -> None:
        raise ConnectionError("redis went first")

    async def works() -> None:
        ran.append("recorder")

    async def stop() -> None:
        await state._step("shared state", hangs())
        await state._step("KV events of p0", fails())
        await state._step("recorder", works())

    with caplog.at_level(logging.WARNING, logger="stack.router"):
        asyncio.run(asyncio.wait_for(stop(), 5))
    assert ran == ["recorder"]
    text = caplog.text
    assert "shared state did not stop within" in text
    assert "KV events of p0 failed (ConnectionError: redis went first)" in text
