"""Sessions: the decoding state of a conversation, kept between runs so a follow-up turn prefills only its
new tokens (the seed notes: ~98% of reprocessing avoided over a 10-turn chat).

A session holds the conversation's tokens, the cache (KV of full-attention layers, conv + recurrent state of
linear-attention layers) covering ``tokens[:cache.offset]``, the chat messages when it came from a chat, and
what it belongs to: a fingerprint of the packed model (SHA-256 of its manifest, which carries every record's
and dense file's checksum) and K (experts per token), both checked on load.

File format: one ``np.savez`` archive (no pickles) written to a temporary sibling and renamed over the
target, so a crash leaves the previous session intact. Keys: ``session.version`` (int), ``session.fingerprint``
(str), ``session.model`` (str, the path, for messages), ``session.k`` (int), ``session.tokens`` (int64 [N]),
``session.messages`` (JSON str), and ``cache.<name>`` for each entry of ``Cache.state_dict()``.

Resuming (:meth:`Session.prepare`): the new context's ids are compared with the tokens already in the cache;
the common prefix is kept. A cache can only be cut back when every stateful layer is full attention (KV
entries can be dropped; a linear-attention state cannot be rewound), otherwise it restarts from empty.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MoepackError
from ..layout.atomic import fsync_dir
from ..layout.constants import MANIFEST_NAME
from .cache import Cache

SESSION_VERSION = 1


class SessionError(MoepackError):
    """A session file cannot be used with this model: damaged, another model, other settings."""

    default_hint = "start a new session: pass another --session file, or delete this one"


def model_fingerprint(model) -> str:
    """SHA-256 of the packed model's manifest (it carries every record's and dense file's checksum)."""
    return hashlib.sha256(Path(model.packed.path, MANIFEST_NAME).read_bytes()).hexdigest()


@dataclass
class Session:
    """A conversation in progress: ``cache`` holds ``tokens[:cache.offset]``; the rest is fed next time."""

    fingerprint: str
    experts_per_token: int
    cache: Cache
    tokens: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # chat turns so far ({"role", "content"})
    model_path: str = ""

    @classmethod
    def new(cls, model) -> "Session":
        return cls(model_fingerprint(model), model.experts_per_token, model.new_cache(), [], [],
                   str(model.packed.path))

    @property
    def processed(self) -> int:
        return self.cache.offset

    def reset(self, model) -> None:
        self.cache = model.new_cache()
        self.tokens = []
        self.messages = []

    # ------------------------------------------------------------------------------------------ contexts
    def ids_context(self, new_ids) -> list[int]:
        """The whole context when `new_ids` are appended to the conversation."""
        return self.tokens + [int(i) for i in new_ids]

    def chat_context(self, tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
        """The whole context for `messages` (the full conversation) through the chat template.

        When the rendered conversation starts with the text of the tokens the cache holds (the usual case: the
        template appends the new turn), those tokens are kept as they are and only the rest is encoded, so a
        reply the model generated need not survive a decode/encode round trip; otherwise the whole rendering
        is encoded. The last generated token (never fed, e.g. an end-of-sequence token other than the one the
        template writes) is not kept: the rendering decides what follows the reply."""
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        done = self.tokens[: self.cache.offset]
        if done:
            before = tokenizer.decode(done)
            if before and text.startswith(before):
                return done + tokenizer.encode(text[len(before):], add_special_tokens=False)
        return tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------------------------------ resume
    def prepare(self, model, context: list[int]) -> int:
        """Make the cache a prefix of `context`; returns how many of its tokens are already processed
        (at most len(context) - 1: the last token is always fed, its logits start generation)."""
        if not context:
            raise MoepackError("nothing to run: the prompt is empty")
        done = self.cache.offset
        common = 0
        limit = min(done, len(context) - 1)
        while common < limit and self.tokens[common] == context[common]:
            common += 1
        if common < done:
            if self._can_truncate():
                self.cache = _truncated(self.cache, common)
            else:
                self.cache = model.new_cache()
                common = 0
        self.tokens = list(context)
        return common

    def _can_truncate(self) -> bool:
        return all(s.kind in ("attention", "none") for s in self.cache.specs)

    # ------------------------------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        arrays = {
            "session.version": np.array(SESSION_VERSION, dtype=np.int64),
            "session.fingerprint": np.array(self.fingerprint),
            "session.model": np.array(self.model_path),
            "session.k": np.array(self.experts_per_token, dtype=np.int64),
            "session.tokens": np.array(self.tokens, dtype=np.int64),
            "session.messages": np.array(json.dumps(self.messages, ensure_ascii=False)),
        }
        arrays.update({f"cache.{k}": v for k, v in self.cache.state_dict().items()})
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:  # a file object: np.savez would append '.npz' to a name
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def _truncated(cache: Cache, n: int) -> Cache:
    """A copy of a full-attention-only cache holding its first n positions."""
    sd = cache.state_dict()
    sd["offset"] = np.array(n, dtype=np.int64)
    for key in list(sd):
        if key.endswith(".keys") or key.endswith(".values"):
            sd[key] = sd[key][:n]
    return Cache.from_state_dict(sd)


def load_session(path: str | os.PathLike, model) -> Session:
    """The session saved at `path`, checked against `model` (fingerprint, K, layer layout, consistency)."""
    path = Path(path)
    damaged = f"session file {path} is damaged or truncated"
    try:
        with np.load(path, allow_pickle=False) as z:
            d = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError) as e:
        raise SessionError(f"{damaged} ({type(e).__name__}: {e})") from None
    try:
        version = int(d["session.version"])
        fingerprint = str(d["session.fingerprint"])
        model_path = str(d["session.model"])
        k = int(d["session.k"])
        tokens = [int(t) for t in np.asarray(d["session.tokens"]).reshape(-1)]
        messages = json.loads(str(d["session.messages"]))
    except (KeyError, TypeError, ValueError) as e:
        raise SessionError(f"{damaged} (lacks or garbles {e})") from None
    if version > SESSION_VERSION:
        raise SessionError(f"session file {path} has version {version}; this moepack reads up to {SESSION_VERSION}",
                           hint="upgrade moepack, or start a new session")
    if fingerprint != model_fingerprint(model):
        raise SessionError(f"session file {path} belongs to another model ({model_path}), not {model.packed.path}",
                           hint="use another --session file for this model, or run the model it was made with")
    if k != model.experts_per_token:
        raise SessionError(f"session file {path} was made with --experts-per-token {k}, this run uses "
                           f"{model.experts_per_token}", hint=f"pass --experts-per-token {k}, or start a new session")
    state = {key[len("cache."):]: v for key, v in d.items() if key.startswith("cache.")}
    try:
        cache = Cache.from_state_dict(state)
    except MoepackError as e:
        raise SessionError(f"{damaged} ({e.message})") from None
    cache.check_compatible(model.new_cache().specs)
    if cache.offset > len(tokens) or not isinstance(messages, list):
        raise SessionError(f"{damaged} (its cache covers {cache.offset} tokens, it lists {len(tokens)})")
    return Session(fingerprint, k, cache, tokens, messages, model_path)


def open_session(path: str | os.PathLike | None, model) -> Session:
    """The session at `path` if that file exists, else a new one (saved there later)."""
    if path is not None and Path(path).exists():
        return load_session(path, model)
    return Session.new(model)
