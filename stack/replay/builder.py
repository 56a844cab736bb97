"""Chat requests whose content reproduces a trace's block structure.

Every trace block (64 tokens in the agentic format, 512 in the Mooncake format) becomes a
run of ``block_size`` words, each word one token of the target's tokenizer (" the",
" cache", ...), chosen by a PRNG seeded from the block's key. So the same block ids give
the same text, and two prompts share exactly as many tokens as the trace says they share.

Conversations are append-only as an agent's are: a follow-up whose blocks extend its
predecessor's (the same agent stream) is the predecessor's messages plus an assistant
message (the predecessor's answer: the first ``output_len`` words of the new blocks) plus
a user message (the rest: tool results, the next instruction). The router therefore
derives the turn (assistant messages + 1) and est_hit (the history up to the last
assistant message) from the request itself. A stream's first turn, or a follow-up whose
history was rewritten (compaction: it shares less than its predecessor's prompt), is a
fresh conversation with one user message: a router sees a first turn, as it would live.

Word lists: with ``tokenizer`` (a local directory holding an HF ``tokenizer.json``) the
words are picked from its vocabulary so that each is exactly one token and words never
merge across boundaries (checked); without one, a list of common English words that are
single tokens in the usual BPE vocabularies (then lengths are approximate).
"""

from __future__ import annotations

import gzip
import io
import random
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import xxhash

_COMMON = (
    "the of and to in is that for it as with was on be by this are from or at an which have not but "
    "all were when we there can more if one will so about out up their what time new code test file "
    "run build value data page block hash store model cache token router request session agent tool "
    "call result output input error list line name type path read write open close start stop first "
    "last next time year day work part case point group number world area state system program "
    "question school country home water room mother money story fact month lot right study book eye "
    "job word business issue side kind head house service friend father power hour game end member "
    "law car city community team minute idea kid body information back parent face others level office "
    "door health person art war history party change morning reason research girl guy moment air "
    "teacher force education foot boy age policy process music market sense nation plan college "
    "interest death experience effect use class control care field development role effort rate heart "
    "drug show leader light voice wife police mind price report decision son view relationship town road "
    "arm difference value building action model season society tax director position player record paper "
    "space ground form event official matter center couple site project activity star table need court"
).split()


@dataclass
class Vocab:
    """Words that are one token each (``tokens_per_word`` when not checked)."""

    words: list[str]
    tokens_per_word: float = 1.0
    exact: bool = False
    source: str = "builtin"

    @classmethod
    def builtin(cls) -> Vocab:
        seen: dict[str, None] = {}
        for w in _COMMON:
            seen.setdefault(" " + w, None)
        return cls(list(seen), 1.0, False, "builtin")

    @classmethod
    def from_tokenizer(cls, path: str | Path) -> Vocab:
        """Single-token words of a local HF tokenizer (a dir with tokenizer.json, or the file)."""
        from tokenizers import Tokenizer

        p = Path(path)
        tj = p / "tokenizer.json" if p.is_dir() else p
        if not tj.exists():
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        tok = Tokenizer.from_file(str(tj))
        cands = []
        for piece in tok.get_vocab():
            if len(piece) >= 3 and piece[0] in ("Ġ", "▁") and piece[1:].isascii() and piece[1:].isalpha():
                cands.append(" " + piece[1:].lower())
        words = []
        for w in sorted(set(cands)):
            if len(tok.encode(w, add_special_tokens=False).ids) == 1:
                words.append(w)
        if len(words) < 16:
            raise ValueError(f"tokenizer {p}: only {len(words)} single-token words; cannot build block texts")
        words = words[:4096]
        # check: a run of words tokenizes to one token per word, also after a newline
        rng = random.Random(0)
        sample = "".join(rng.choice(words) for _ in range(512))
        n = len(tok.encode("\n" + sample, add_special_tokens=False).ids)
        if n != 513:
            # drop words that merge with neighbours, then re-check once
            bad = set()
            for w in words:
                if len(tok.encode(w + w + "\n" + w, add_special_tokens=False).ids) != 4:
                    bad.add(w)
            words = [w for w in words if w not in bad]
            sample = "".join(rng.choice(words) for _ in range(512))
            if len(words) < 16 or len(tok.encode("\n" + sample, add_special_tokens=False).ids) != 513:
                return cls(words or cls.builtin().words, n / 513, False, str(tj))
        return cls(words, 1.0, True, str(tj))


def words_of(seed: int, n: int, vocab: Vocab) -> str:
    rng = random.Random(seed)
    return "".join(rng.choices(vocab.words, k=n))


# -- the trace's block ids ---------------------------------------------------------------------
def _open(path: Path) -> io.TextIOBase:
    raw = path.open("rb")
    head = raw.read(2)
    raw.seek(0)
    if head == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8")
    return io.TextIOWrapper(raw, encoding="utf-8")


def read_block_ids(path: str | Path, limit: int | None = None) -> tuple[list[list[int]], str]:
    """Per request (in file order, as ``stack.traces.load.load_trace`` numbers them), its
    block ids, and the format (agentic | mooncake). Agentic ids are cut to ``n_blocks`` (and
    to ``input_length // 64``) exactly as the loader does."""
    out: list[list[int]] = []
    fmt = ""
    with _open(Path(path)) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            if limit is not None and len(out) >= limit:
                break
            rec = orjson.loads(line)
            if "hash_id_ranges" in rec:
                fmt = fmt or "agentic"
                ids: list[int] = []
                for a, b in rec["hash_id_ranges"]:
                    ids.extend(range(int(a), int(b) + 1))
                L = max(1, int(rec.get("input_length") or 0))
                n = min(int(rec.get("n_blocks") or len(ids)), len(ids), L // 64)
                out.append(ids[:n])
            else:
                fmt = fmt or "mooncake"
                out.append([int(h) for h in rec.get("hash_ids") or []])
    return out, fmt


# -- conversations -----------------------------------------------------------------------------
@dataclass
class Built:
    """One request's messages and what the builder expects of it."""

    messages: list[dict]
    fresh: bool  # a new conversation (turn 1 for the router)
    words: int  # content words (≈ tokens) in all messages
    history_words: int  # words up to the end of the last assistant message (est_hit)


@dataclass
class Conversations:
    """Builds the messages of each replayed request; holds each stream's last conversation.

    ``key_of(copy, block)`` gives the seed of a block's text: agentic block ids are local to
    a session, so every replayed copy (distinct ``copy``) gets its own texts; Mooncake ids
    are global chained hashes, shared across sessions, so only repeats of the trace differ.
    """

    block_ids: list[list[int]]
    fmt: str
    block_size: int
    vocab: Vocab = field(default_factory=Vocab.builtin)
    n_sessions: int = 1
    _texts: dict = field(default_factory=dict)

    def _key(self, copy: int, block: int) -> int:
        rep = copy if self.fmt == "agentic" else copy // max(1, self.n_sessions)
        return xxhash.xxh3_64_intdigest(b"%d:%d" % (rep, block))

    def block_text(self, copy: int, block: int) -> str:
        k = self._key(copy, block)
        t = self._texts.get(k)
        if t is None:
            t = words_of(k, self.block_size, self.vocab)
            self._texts[k] = t
        return t

    def forget_copy(self, copy: int) -> None:
        """Nothing to do for texts (they may be shared); kept for symmetry with streams."""

    def build(self, copy: int, idx: int, prev: Built | None, prev_idx: int, prev_output: int) -> Built:
        """Messages of trace request ``idx`` replayed as copy ``copy``.

        ``prev`` / ``prev_idx`` / ``prev_output``: the stream predecessor's built request,
        trace index and output length (``prev`` None for a stream's first turn).
        """
        ids = self.block_ids[idx]
        bs = self.block_size
        if prev is not None and prev_idx >= 0:
            pids = self.block_ids[prev_idx]
            m = min(len(pids), len(ids))
            lcp = 0
            # fast path: appended (compare the boundary first)
            if m and ids[:m] == pids[:m]:
                lcp = m
            else:
                while lcp < m and ids[lcp] == pids[lcp]:
                    lcp += 1
            # the predecessor's last block is often partial and reappears complete under a
            # new id: one block of slack (and 2% for long prompts) still counts as appended
            if lcp >= len(pids) - max(1, len(pids) // 50):
                new = ids[lcp:]
                text = "".join(self.block_text(copy, b) for b in new)
                # split the new words: the answer (output_len words), then the next input
                n_words = len(new) * bs
                a_words = min(max(1, prev_output), max(0, n_words - 1))
                cut = _word_offset(text, a_words)
                answer = text[:cut] or self._filler(copy, idx, 0)
                rest = text[cut:] or self._filler(copy, idx, 1)
                a_n = max(1, a_words)
                messages = prev.messages + [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": rest},
                ]
                total = prev.words + a_n + max(1, n_words - a_words)
                return Built(messages, False, total, prev.words + a_n)
        text = "".join(self.block_text(copy, b) for b in ids) or self._filler(copy, idx, 0)
        return Built([{"role": "user", "content": text}], True, max(1, len(ids) * bs), 0)

    def _filler(self, copy: int, idx: int, k: int) -> str:
        seed = xxhash.xxh3_64_intdigest(b"f%d:%d:%d" % (copy, idx, k))
        return words_of(seed, 1, self.vocab)


def _word_offset(text: str, n: int) -> int:
    """Char offset just after the first ``n`` words (words start with a space)."""
    if n <= 0:
        return 0
    pos = 0
    for _ in range(n):
        nxt = text.find(" ", pos + 1)
        if nxt < 0:
            return len(text)
        pos = nxt
    return pos
