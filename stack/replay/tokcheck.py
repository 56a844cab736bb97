"""Before a replay starts: does the target count the replay's prompts as the builder does?

The builder sizes prompts in words of its vocabulary (one token each with ``--tokenizer``,
about one with the built-in list). A target that tokenizes with another tokenizer sees
other lengths (the tiny model of ``smetric up`` counts the built-in words at about two
tokens each: prompts twice the trace's, some over the context length). So the replay asks,
as an SGLang worker answers: ``GET /model_info`` (``tokenizer_path``) and ``POST
/v1/tokenize`` with probe prompts built from the replay's own vocabulary, and compares the
target's counts with the words it meant. A mismatch beyond :data:`TOLERANCE` refuses the
run (:class:`TokenizerMismatch`, exit 2) and names the tokenizer to pass. A target that has
neither endpoint (404, 405, 501, unreachable) is replayed as before, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stack.replay.builder import Vocab, words_of

log = logging.getLogger("stack.replay")

#: probe prompt lengths (words of the replay's vocabulary)
PROBE_WORDS = (64, 512, 2048)
#: allowed |target count - intended| per probe: this many tokens (special tokens a target adds
#: despite add_special_tokens=false) plus this fraction (the built-in list is approximate)
TOLERANCE = (4, 0.05)


class TokenizerMismatch(ValueError):
    """The target counts the replay's prompts differently from the replay's builder."""


@dataclass
class Check:
    """What the pre-flight check found (reported under ``tokenizer_check`` in the output)."""

    target_tokenizer: str | None = None
    model_info: bool = False
    checked: bool = False
    probes: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "target_tokenizer": self.target_tokenizer,
            "model_info": self.model_info,
            "checked": self.checked,
            "probes": self.probes,
            "warnings": self.warnings,
        }


def probes(vocab: Vocab) -> list[tuple[str, int]]:
    """(text, intended tokens) of each probe, built as the builder builds block texts."""
    return [
        (words_of(1_000_003 + n, n, vocab), max(1, round(n * vocab.tokens_per_word))) for n in PROBE_WORDS
    ]


def within(count: int, intended: int) -> bool:
    a, f = TOLERANCE
    return abs(count - intended) <= a + f * intended


def _same_path(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


async def check_tokenizer(
    client: httpx.AsyncClient, vocab: Vocab, tokenizer: str | None, timeout: float = 5.0
) -> Check:
    """Compare the target's token counts with the builder's; raise :class:`TokenizerMismatch`
    on a mismatch. ``tokenizer``: the replay's ``--tokenizer`` (None: the built-in words)."""
    chk = Check()

    def warn(msg: str) -> None:
        chk.warnings.append(msg)
        log.warning("replay: %s", msg)

    try:
        r = await client.get("/model_info", timeout=timeout)
        if r.status_code == 200 and isinstance(info := r.json(), dict):
            chk.model_info = True
            tp = info.get("tokenizer_path")
            chk.target_tokenizer = tp if isinstance(tp, str) and tp else None
        else:
            warn(f"the target has no /model_info (HTTP {r.status_code}): its tokenizer is unknown")
    except (httpx.HTTPError, ValueError) as e:
        warn(f"cannot ask the target's /model_info ({type(e).__name__}): its tokenizer is unknown")
        return chk  # unreachable or hung: the run itself will count the errors
    built = probes(vocab)
    try:
        r = await client.post(
            "/v1/tokenize",
            json={"prompt": [t for t, _ in built], "add_special_tokens": False},
            timeout=max(timeout, 10.0),
        )
        counts = r.json().get("count") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        counts, r = None, None
        warn(f"cannot ask the target's /v1/tokenize ({type(e).__name__})")
    if not (
        isinstance(counts, list) and len(counts) == len(built) and all(isinstance(c, int) for c in counts)
    ):
        if r is not None:
            warn(
                f"the target does not count tokens (/v1/tokenize: HTTP {r.status_code}); "
                "prompt lengths are unchecked"
            )
        if tokenizer and chk.target_tokenizer and not _same_path(tokenizer, chk.target_tokenizer):
            warn(f"--tokenizer {tokenizer} differs from the target's tokenizer_path {chk.target_tokenizer}")
        return chk
    chk.checked = True
    bad = []
    for (_, want), got in zip(built, counts, strict=True):
        ok = within(got, want)
        chk.probes.append({"intended": want, "target": got, "ok": ok})
        if not ok:
            bad.append((want, got))
    if bad:
        want, got = bad[-1]
        ours = f"--tokenizer {tokenizer}" if tokenizer else "the built-in word list (no --tokenizer)"
        if chk.target_tokenizer:
            fix = f"pass --tokenizer {chk.target_tokenizer} (the target's tokenizer_path, from /model_info)"
        else:
            fix = "pass --tokenizer DIR with the target's tokenizer.json (its /model_info names none)"
        raise TokenizerMismatch(
            f"tokenizer mismatch: the target counts {got} tokens for a probe prompt built as {want} "
            f"with {ours} (tolerance {TOLERANCE[0]} + {TOLERANCE[1]:.0%}); its prompts would be "
            f"{got / max(1, want):.2f}x the trace's lengths. {fix}, or --no-tokenizer-check to replay anyway"
        )
    if tokenizer and chk.target_tokenizer and not _same_path(tokenizer, chk.target_tokenizer):
        log.info("replay: --tokenizer %s counts as the target's %s", tokenizer, chk.target_tokenizer)
    return chk
