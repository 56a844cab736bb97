"""The router's tokenizer: a local model's tokenizer (HF ``tokenizers``) and chat template
(jinja2, rendered as transformers does), with segment-cached encoding. Nothing is fetched
from a hub.

Tokenization is the router's main cost (agent prompts run to ~100k+ tokens) and agent
requests are append-only, so the rendered prompt is cut into segments just before the
template's structural special tokens (e.g. ``<|im_start|>``) and each segment's token ids
are cached (LRU, bounded in tokens: :class:`SegmentCache`). Cutting there is exact: HF
tokenizers extract added tokens before normalising and pre-tokenising the text between them,
so encoding the segments one by one yields the very ids of encoding the whole text. Only
tokens that do not strip whitespace around them are used as cut points. A follow-up turn
then tokenizes only its new messages.

The thread doing a request's feature work carries a scope: a cancel event
(:func:`cancellable`, set when the client leaves) and an inline budget
(:func:`inline_budget`), both checked by :meth:`Tokenizer.encode`.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from stack.prefill_router.errors import Cancelled, ClientError, NeedsOffload, OverContext

if TYPE_CHECKING:
    from stack.prefill_router.shared_tokens import SharedTokens


#: what the thread doing a request's feature work may check: ``cancel`` (a
#: ``threading.Event``, set when the client leaves; see ``stack.prefill_router.offload``)
#: and ``budget`` (characters of uncached text it may tokenize, see :func:`inline_budget`)
_scope = threading.local()


def _on_event_loop() -> bool:
    """Whether this thread runs an event loop: the feature work of a small or warm body is
    done there, where no blocking round trip may be (the shared token cache is asked only
    from the feature pool's threads, by the bodies with the most to tokenize)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@contextmanager
def inline_budget(chars: int):
    """Within this block, :meth:`Tokenizer.encode` on this thread tokenizes at most ``chars``
    characters of text not in its cache, and raises :class:`NeedsOffload` rather than more."""
    old = getattr(_scope, "budget", None)
    _scope.budget = chars
    try:
        yield
    finally:
        _scope.budget = old


@contextmanager
def cancellable(ev: threading.Event):
    """Within this block, the feature work on this thread stops at its next batch boundary
    (:class:`Cancelled`) once ``ev`` is set (the feature pool sets it when the client leaves)."""
    _scope.cancel = ev
    try:
        yield
    finally:
        _scope.cancel = None


def check_cancel() -> None:
    """Raise :class:`Cancelled` when this thread's request was cancelled (:func:`cancellable`)."""
    ev = getattr(_scope, "cancel", None)
    if ev is not None and ev.is_set():
        raise Cancelled()


class Encoded(NamedTuple):
    tokens: np.ndarray
    ends: list[tuple[int, int]]  # (end offset in chars, tokens) per segment of the text
    cached: int  # tokens served from the cache
    serials: list[int]  # cache serial per part (-1: not cached)
    sizes: list[int]  # tokens per part


class SegmentCache:
    """LRU of segment text -> (serial, token ids), bounded by the total tokens it holds.

    Each cached segment gets a unique serial (never reused), so a sequence of serials
    identifies a token prefix without looking at the tokens (see ``HashMemo``).
    """

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.d: OrderedDict[str, tuple[int, np.ndarray]] = OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._serial = 16  # 0..15 reserved

    def get(self, seg: str) -> tuple[int, np.ndarray] | None:
        v = self.d.get(seg)
        if v is not None:
            self.d.move_to_end(seg)
            self.hits += 1
        else:
            self.misses += 1
        return v

    def put(self, seg: str, ids: np.ndarray) -> int:
        """Cache ``ids``; returns its serial, or -1 when it was too large to cache."""
        if self.capacity <= 0 or len(ids) > self.capacity:
            return -1
        old = self.d.pop(seg, None)
        if old is not None:
            self.tokens -= len(old[1])
        self._serial += 1
        self.d[seg] = (self._serial, ids)
        self.tokens += len(ids)
        while self.tokens > self.capacity and self.d:
            _, (_, v) = self.d.popitem(last=False)
            self.tokens -= len(v)
        return self._serial

    def __len__(self) -> int:
        return len(self.d)


def _raise_exception(msg):
    raise ClientError(f"chat template: {msg}", param="messages", code="invalid_messages")


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    """Tokenizer + chat template of a local model dir, with segment-cached encoding."""

    def __init__(self, model_path: str | Path, cache_tokens: int = 8_000_000) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(model_path)
        tj = p / "tokenizer.json"
        if not tj.exists():
            raise FileNotFoundError(f"no tokenizer.json in model dir {p}")
        self.hf = HFTokenizer.from_file(str(tj))
        cfg = {}
        tc = p / "tokenizer_config.json"
        if tc.exists():
            cfg = json.loads(tc.read_text())
        template = cfg.get("chat_template")
        jt = p / "chat_template.jinja"
        if jt.exists():
            template = jt.read_text()
        if isinstance(template, list):  # [{name, template}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.template_src: str | None = template
        self.special_values = {
            k: _tok_str(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.template = None
        if template:
            from jinja2 import ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self.template = env.from_string(template)
        # cut points: special added tokens that appear in the template and strip nothing
        cuts = []
        for t in self.hf.get_added_tokens_decoder().values():
            if not t.special or t.lstrip or t.single_word or not t.content:
                continue
            if template and t.content in template:
                cuts.append(t.content)
        # one cut per message is enough (fewer, larger segments: fewer cache lookups): prefer
        # the message-start tokens (<|im_start|>, <|start_header_id|>) when the template has them
        starts = [c for c in cuts if "start" in c.lower()]
        self.cut_tokens = sorted(set(starts or cuts), key=len, reverse=True)
        self._cut_re = (
            re.compile("|".join(re.escape(c) for c in self.cut_tokens)) if self.cut_tokens else None
        )
        # prefix/suffix the post-processor adds to a plain prompt (e.g. BOS)
        self.special_prefix = np.asarray(self.hf.encode("", add_special_tokens=True).ids, dtype="<u4")
        self.cache = SegmentCache(cache_tokens)
        self.lock = threading.Lock()  # the cache's; encoding itself runs outside it
        #: router replicas' shared segment ids (router.redis_token_cache), or None
        self.shared: SharedTokens | None = None
        self.bytes_per_token = _max_bytes_per_token(self.hf, tj)
        self.chunk_safe = _chunk_safe(self.hf, tj)

    # -- bounds -----------------------------------------------------------------------
    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text``, from its length alone (0: no bound for
        this tokenizer). Every token covers at most ``bytes_per_token`` bytes of the text, so
        a text of B bytes has at least B / bytes_per_token tokens."""
        if not self.bytes_per_token:
            return 0
        n = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return n // self.bytes_per_token

    # -- rendering ----------------------------------------------------------------------
    def render(
        self, messages: list, tools=None, add_generation_prompt: bool = True, extra: dict | None = None
    ) -> str:
        if self.template is None:
            raise ClientError("the model has no chat template; use /v1/completions", code="no_chat_template")
        from jinja2 import TemplateError

        kw = dict(self.special_values)
        if extra:
            kw.update({k: v for k, v in extra.items() if k not in ("messages", "tools")})
        try:
            return self.template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kw
            )
        except ClientError:
            raise
        except (TemplateError, TypeError, KeyError, AttributeError, ValueError, IndexError) as e:
            raise ClientError(
                f"cannot apply the chat template: {e}", param="messages", code="invalid_messages"
            ) from None

    # -- tokenization -------------------------------------------------------------------
    def segments(self, text: str) -> list[str]:
        if self._cut_re is None or len(text) < 256:
            return [text] if text else []
        starts = [m.start() for m in self._cut_re.finditer(text)]
        if not starts:
            return [text]
        out = []
        prev = 0
        for s in starts:
            if s > prev:
                out.append(text[prev:s])
            prev = s
        out.append(text[prev:])
        return out

    def chunks(self, seg: str) -> list[str]:
        """``seg`` cut into pieces of about ``CHUNK_CHARS`` characters whose encodings,
        concatenated, are the encoding of ``seg``. Cuts fall only on pre-token boundaries of
        the byte-level regex pre-tokenizers (GPT-2, Llama 3, Qwen 2 patterns): after a
        newline followed by a letter, or before a space between two letters; checked per
        tokenizer at load (:func:`_chunk_safe`). One piece when the tokenizer is not known
        safe, or when no such point occurs."""
        n = len(seg)
        if n <= CHUNK_CHARS * 2 or not self.chunk_safe:
            return [seg]
        out = []
        prev = 0
        while n - prev > CHUNK_CHARS * 2:
            cut = _safe_cut(seg, prev + CHUNK_CHARS, prev + CHUNK_CHARS * 2)
            if cut < 0:
                break  # no safe cut in the window: the rest stays one piece
            out.append(seg[prev:cut])
            prev = cut
        out.append(seg[prev:])
        return out

    def encode(self, text: str, add_special_tokens: bool = False, limit: int | None = None) -> Encoded:
        """Token ids of ``text``, with per-segment offsets and the parts' cache serials.

        Uncached segments are encoded with ``encode_batch_fast`` (no offsets; it releases
        the GIL), in batches of about ``BATCH_CHARS`` characters. ``limit``: raise
        :class:`OverContext` as soon as the tokens reach it (the rest is not encoded). A
        request whose client left (see ``_scope``) raises :class:`Cancelled` between
        batches."""
        segs = self.segments(text)
        parts: list[np.ndarray | None] = []
        serials: list[int] = []
        missing: list[int] = []
        cached = 0
        cache = self.cache
        with self.lock:
            for i, s in enumerate(segs):
                v = cache.get(s)
                if v is None:
                    missing.append(i)
                    parts.append(None)
                    serials.append(-1)
                else:
                    cached += len(v[1])
                    parts.append(v[1])
                    serials.append(v[0])
        if missing:
            budget = getattr(_scope, "budget", None)
            if budget is not None and sum(len(segs[i]) for i in missing) > budget:
                raise NeedsOffload()
            if self.shared is not None and not _on_event_loop():
                cached += self._from_shared(segs, missing, parts, serials)
        if missing:
            self._encode_missing(segs, missing, parts, serials, cached, limit, add_special_tokens)
            if self.shared is not None:
                self.shared.put([(segs[i], parts[i]) for i in missing if self.shared.shares(segs[i])])
        elif limit is not None and cached + (len(self.special_prefix) if add_special_tokens else 0) >= limit:
            raise OverContext(cached)
        ends = []
        pos = 0
        for s, v in zip(segs, parts, strict=True):
            pos += len(s)
            ends.append((pos, len(v)))
        if add_special_tokens and len(self.special_prefix):
            parts.insert(0, self.special_prefix)
            serials.insert(0, 1)
        if not parts:
            return Encoded(np.zeros(0, dtype="<u4"), ends, cached, serials, [])
        tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return Encoded(tokens, ends, cached, serials, [len(p) for p in parts])

    def _from_shared(self, segs, missing, parts, serials) -> int:
        """Fill the missing segments that other router replicas shared
        (:mod:`stack.prefill_router.shared_tokens`), caching them here too; ``missing`` keeps
        the rest. Returns the tokens filled."""
        asked = [i for i in missing if self.shared.shares(segs[i])]
        if not asked:
            return 0
        shared = self.shared.get([segs[i] for i in asked])  # a round trip: outside the lock
        got = 0
        found = set()
        with self.lock:
            for i, ids in zip(asked, shared, strict=True):
                if ids is not None:
                    parts[i] = ids
                    serials[i] = self.cache.put(segs[i], ids)
                    got += len(ids)
                    found.add(i)
        if found:
            missing[:] = [i for i in missing if i not in found]
        return got

    def _encode_missing(self, segs, missing, parts, serials, cached, limit, add_special_tokens) -> None:
        pieces: list[tuple[int, str]] = []
        for i in missing:
            pieces.extend((i, c) for c in self.chunks(segs[i]))
        have = cached + (len(self.special_prefix) if add_special_tokens else 0)
        got: dict[int, list[np.ndarray]] = {i: [] for i in missing}
        enc = self.hf.encode_batch_fast
        b = 0
        while b < len(pieces):
            check_cancel()
            e = b + 1
            size = len(pieces[b][1])
            while e < len(pieces) and size + len(pieces[e][1]) <= BATCH_CHARS:
                size += len(pieces[e][1])
                e += 1
            batch = pieces[b:e]
            for (i, _), r in zip(batch, enc([c for _, c in batch], add_special_tokens=False), strict=True):
                arr = np.asarray(r.ids, dtype="<u4")
                got[i].append(arr)
                have += len(arr)
            if limit is not None and have >= limit:
                raise OverContext(have)
            b = e
        with self.lock:
            for i in missing:
                g = got[i]
                arr = g[0] if len(g) == 1 else np.concatenate(g)
                parts[i] = arr
                serials[i] = self.cache.put(segs[i], arr)


_CUT_RE = re.compile(r"\n(?=\w)|(?<=\w) (?=\w)")


def _safe_cut(text: str, start: int, end: int) -> int:
    """The first offset in [start, end) where ``text`` may be cut (see
    :meth:`Tokenizer.chunks`), or -1."""
    for m in _CUT_RE.finditer(text, start, end):
        i = m.start()
        if text[i] == "\n":
            if text[i + 1].isalpha():
                return i + 1
        elif text[i - 1].isalpha() and text[i + 1].isalpha():
            return i
    return -1


#: pieces of a long segment encoded separately (see :meth:`Tokenizer.chunks`)
CHUNK_CHARS = 64 * 1024
#: characters per ``encode_batch_fast`` call: between two calls a request can be cancelled
#: or refused as over the context
BATCH_CHARS = 512 * 1024


def _tokenizer_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _byte_level(spec: dict | None) -> bool:
    """Whether a ``pre_tokenizer`` spec maps text to bytes (ByteLevel, alone or last in a
    Sequence of regex splits)."""
    if not isinstance(spec, dict):
        return False
    if spec.get("type") == "ByteLevel":
        return True
    if spec.get("type") == "Sequence":
        subs = spec.get("pretokenizers") or []
        return (
            bool(subs)
            and all(isinstance(p, dict) and p.get("type") in ("Split", "ByteLevel", "Digits") for p in subs)
            and any(p.get("type") == "ByteLevel" for p in subs)
        )
    return False


#: how much a normalizer may shrink a text, in bytes (NFC/NFKC compose; e.g. 3 Hangul jamo,
#: 9 bytes, become one 3-byte syllable); a normalizer not listed here: no length bound
_SHRINK = {None: 1, "NFC": 3, "NFKC": 3, "NFD": 1, "NFKD": 1}


def _shrink(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    if not isinstance(spec, dict):
        return None
    if spec.get("type") == "Sequence":
        f = 1
        for n in spec.get("normalizers") or []:
            g = _shrink(n)
            if g is None:
                return None
            f *= g
        return f
    return _SHRINK.get(spec.get("type"))


def _max_bytes_per_token(hf, tj: Path) -> int:
    """The most bytes of input text one token can cover (times the normalizer's shrink
    factor), from the vocabulary; 0 when no safe figure is known. Byte-level vocabularies
    spell one byte per character; others are counted in UTF-8 bytes (a byte-fallback token
    such as ``<0x0A>`` counts 6 for its 1 byte: an overestimate, so still safe)."""
    spec = _tokenizer_json(tj)
    f = _shrink(spec.get("normalizer"))
    if f is None:
        return 0
    byte_level = _byte_level(spec.get("pre_tokenizer"))
    longest = 0
    for t in hf.get_vocab(with_added_tokens=False):
        longest = max(longest, len(t) if byte_level else len(t.encode("utf-8", "surrogatepass")))
    for t in hf.get_added_tokens_decoder().values():
        longest = max(longest, len(t.content.encode("utf-8", "surrogatepass")))
    return longest * f


_PROBE = (
    "Hello world.\nThe quick brown fox, 123 jumps!\n\nover the lazy dog\n  indented line\n"
    "def f(x):\n    return x*2\n\tTab\n'quoted' text's end\n\u00e9l\u00e8ve \u4e2d\u6587\n"
    "ALLCAPS\n\u0391\u03b2\u03b3 \u043f\u0440\u0438\u0432\u0435\u0442\n-dash\nend"
)


def _chunk_safe(hf, tj: Path) -> bool:
    """Whether cutting where a newline meets a letter keeps the encoding exact, for this
    tokenizer: only byte-level regex pre-tokenizers with no or an NFC normalizer qualify,
    and a probe text must encode the same whole and cut at every such point."""
    spec = _tokenizer_json(tj)
    norm = spec.get("normalizer")
    if not _byte_level(spec.get("pre_tokenizer")) or not (norm is None or norm.get("type") == "NFC"):
        return False
    text = _PROBE * 3
    whole = hf.encode(text, add_special_tokens=False).ids
    cuts = []
    pos = 1
    while (c := _safe_cut(text, pos, len(text) - 1)) >= 0:
        cuts.append(c)
        pos = c + 1
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]
    cut = [t for e in hf.encode_batch_fast(pieces, add_special_tokens=False) for t in e.ids]
    return cut == whole


def _tok_str(x):
    if isinstance(x, dict):
        return x.get("content")
    return x
