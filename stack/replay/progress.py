"""One replay with a progress bar (``smetric replay``, ``demo-live``, ``compare``)."""

from __future__ import annotations


def replay_with_progress(cfg, trace=None, label: str = "replay", show: bool = True) -> dict:
    """Run one replay, with a rich progress bar on stderr when ``show`` (and a terminal)."""
    import asyncio

    from stack.replay.driver import Replay

    rp = Replay(cfg, trace)
    if not show:
        return asyncio.run(rp.run())
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"),
        console=console,
        transient=False,
    ) as prog:
        task = prog.add_task(label, total=1.0, stats="")

        def report(p) -> None:
            prog.update(
                task,
                completed=min(1.0, p.elapsed / p.total),
                stats=f"sent {p.sent}  done {p.done}  in flight {p.inflight}  errors {p.errors}",
            )

        return asyncio.run(rp.run(report))
