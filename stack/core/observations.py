"""Per-request prefill timings as rows: what ``smetric calibrate --from`` reads, what the router's
learned cost model records and exports, and how one is read off SGLang's ``meta_info``.

A row: ``new_tokens`` (computed), ``cached_tokens`` (reused), ``context`` (= new + cached, the
prompt), ``forward_s`` (seconds of the request's prefill forwards), ``queue_s`` (seconds it
waited before its first forward), ``alone`` (no other request shared its forwards, as far as
the recorder knows), ``worker`` and ``t`` (when its first forward started, Unix seconds on the
engine's clock; 0 when unknown). CSV with a
header row, or JSON lines; ``context`` may stand in for ``new_tokens`` (with ``cached_tokens``).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

FIELDS = ("new_tokens", "cached_tokens", "context", "forward_s", "queue_s", "alone", "worker", "t")

#: meta_info's fields that give a prefill's forward time (SGLang's ``--enable-metrics``)
TIMING_KEYS = ("forward_entry_time", "prefill_finished_time")


@dataclass(slots=True)
class Observation:
    new_tokens: int
    cached_tokens: int
    forward_s: float
    queue_s: float = 0.0
    alone: bool = True
    worker: str = ""
    t: float = 0.0

    @property
    def context(self) -> int:
        return self.new_tokens + self.cached_tokens

    @property
    def end(self) -> float:
        """When its prefill finished (engine clock; with ``t``)."""
        return self.t + self.forward_s

    def row(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "cached_tokens": self.cached_tokens,
            "context": self.context,
            "forward_s": round(self.forward_s, 9),
            "queue_s": round(self.queue_s, 9),
            "alone": self.alone,
            "worker": self.worker,
            "t": round(self.t, 3),
        }


def from_meta(meta: Any, worker: str = "", alone: bool = True) -> Observation | None:
    """The prefill timing in an answer's ``meta_info`` (SGLang with ``--enable-metrics``, or the
    emulator's), or None when it carries none (no metrics, an abort, a malformed value)."""
    if not isinstance(meta, dict):
        return None
    try:
        prompt = int(meta["prompt_tokens"])
        cached = int(meta.get("cached_tokens") or 0)
        start, end = float(meta[TIMING_KEYS[0]]), float(meta[TIMING_KEYS[1]])
        queue = float(meta.get("queue_time") or 0.0)
    except (KeyError, TypeError, ValueError):
        return None
    fr = meta.get("finish_reason")
    if isinstance(fr, dict) and fr.get("type") == "abort":
        return None
    new = prompt - cached
    if new <= 0 or start <= 0 or end < start:
        return None
    return Observation(new, cached, end - start, max(0.0, queue), alone, worker, start)


def _bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("0", "false", "no", "")
    return bool(v)


def _parse_row(d: dict[str, Any], where: str) -> Observation:
    try:
        cached = int(float(d.get("cached_tokens") or 0))
        if d.get("new_tokens") not in (None, ""):
            new = int(float(d["new_tokens"]))
        elif d.get("context") not in (None, ""):
            new = int(float(d["context"])) - cached
        else:
            raise KeyError("new_tokens (or context)")
        fwd = d.get("forward_s", d.get("seconds"))
        if fwd in (None, ""):
            raise KeyError("forward_s")
        ob = Observation(
            new,
            cached,
            float(fwd),
            float(d.get("queue_s") or 0.0),
            _bool(d.get("alone", True)),
            str(d.get("worker") or ""),
            float(d.get("t") or 0.0),
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing column {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a number ({e})") from None
    if ob.new_tokens <= 0 or ob.forward_s <= 0:
        raise ValueError(f"{where}: new_tokens and forward_s must be positive")
    return ob


def read_observations(path: str | Path) -> list[Observation]:
    """Rows of a CSV (header row) or JSON-lines file (by its suffix: .csv, else JSON lines)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such observations file: {p}")
    text = p.read_text()
    out: list[Observation] = []
    if p.suffix.lower() == ".csv":
        for i, d in enumerate(csv.DictReader(io.StringIO(text)), start=2):
            out.append(_parse_row(d, f"{p.name}:{i}"))
    else:
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                d = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise ValueError(f"{p.name}:{i}: not JSON ({e})") from None
            if not isinstance(d, dict):
                raise ValueError(f"{p.name}:{i}: not a JSON object")
            out.append(_parse_row(d, f"{p.name}:{i}"))
    if not out:
        raise ValueError(f"{p}: no observations")
    return out


def to_jsonl(obs: Iterable[Observation]) -> bytes:
    return b"".join(orjson.dumps(o.row()) + b"\n" for o in obs)


def to_csv(obs: Iterable[Observation]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    w.writeheader()
    for o in obs:
        w.writerow(o.row())
    return buf.getvalue()
