"""`moepack eval`: quality beyond RMSE. Perplexity of a packed model on a text, and how far its next-token
distributions are from a reference model's (KL divergence, top-1 agreement).

    res = evaluate("q397-2bit/")                                   # perplexity on moepack/data/eval.txt
    res = evaluate("q397-2bit/", text="wiki.txt", source="q397-4bit/")   # + KL(4-bit || 2-bit)
    res.record["perplexity"], res.record["kl_mean"]

How the text is scored (stated in every result): the text is read as UTF-8 and tokenized with the packed
folder's tokenizer as plain text (no chat template, no special tokens added), then cut into consecutive,
non-overlapping windows of ``window`` tokens (default: the model's context length, at most
``DEFAULT_WINDOW``). Each window starts from an empty cache; its first token is context only and every later
token is scored on the tokens before it in the same window. Perplexity is ``exp(mean negative log-likelihood)``
over all scored tokens (natural log).

With a reference (``source``): the reference model (a packed model, or a source checkpoint that is first
packed bit-exactly at its own bits to a temporary folder, so both run through the same runtime) sees the
same windows; for every scored position ``KL(P_reference || P_model) = sum_v p_ref(v) (log p_ref(v) - log
p_model(v))`` in nats, reported as mean, 99th percentile and maximum, with the fraction of positions where
both models' most likely next token is the same (top-1 agreement).

The result is saved as the manifest's ``eval`` section (a flat dict the hub model card shows as a table).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import __version__
from .errors import MoepackError, SourceError

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "eval.txt"
DEFAULT_MAX_TOKENS = 4096
DEFAULT_WINDOW = 1024  # cap on the default window: the model's context can be 262,144 tokens
FORWARD_CHUNK = 512  # tokens per forward call inside a window: bounds the [T, vocab] logits
ROW_BLOCK = 64  # logit rows converted to float64 at a time
RECORDED = True  # evaluate(source=RECORDED): the source recorded in the manifest

# text-config fields that must agree between a model and its reference
_SAME_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "full_attention_interval", "linear_num_key_heads",
                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


class EvalError(MoepackError):
    """The evaluation text or settings cannot be used."""

    default_hint = "pass a UTF-8 text file with --text"


@dataclass
class EvalResult:
    record: dict  # what is saved in the manifest's eval section
    nll: np.ndarray  # negative log-likelihood of every scored token (nats)
    kl: np.ndarray | None  # KL(reference || model) at every scored position, when there is a reference
    seconds: float
    saved: bool = False
    save_error: str | None = None

    def to_json(self) -> dict:
        return {**self.record, "seconds": round(self.seconds, 3), "saved": self.saved}


# ------------------------------------------------------------------------------------------------ text
def read_text(path: str | os.PathLike) -> tuple[str, bytes]:
    """The text of `path` (UTF-8), refusing missing, empty, whitespace-only and binary files."""
    p = Path(path)
    if not p.exists():
        raise EvalError(f"{p}: no such file")
    if not p.is_file():
        raise EvalError(f"{p} is not a file")
    data = p.read_bytes()
    if not data.strip():
        raise EvalError(f"{p} is empty" if not data else f"{p} holds only whitespace",
                        hint="pass a text file with a few paragraphs of the kind of text the model will see")
    nul = data.find(b"\0")
    if nul >= 0:
        raise EvalError(f"{p} is a binary file (NUL byte at offset {nul}), not text",
                        hint="pass a UTF-8 text file with --text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(f"{p} is not UTF-8 text (invalid byte at offset {e.start})",
                        hint="convert it to UTF-8 (e.g. iconv -t UTF-8) or pass another --text") from None
    return text, data


def windows(n: int, window: int) -> list[tuple[int, int]]:
    """Consecutive non-overlapping [start, end) windows over n tokens; a last window of one token (nothing
    to score) is dropped."""
    out = [(s, min(n, s + window)) for s in range(0, n, window)]
    return [w for w in out if w[1] - w[0] >= 2]


def _context(config: dict, text_config: dict) -> int | None:
    for d in (text_config, config):
        v = d.get("max_position_embeddings")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


# ------------------------------------------------------------------------------------------------ math
def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def _score(logits: np.ndarray, targets: np.ndarray, ref_logits: np.ndarray | None):
    """For logits [T, V] predicting targets [T]: (nll [T], reference nll [T] | None, KL(reference || model) [T] |
    None, number of positions where both models' most likely token is the same)."""
    n = len(targets)
    nll = np.empty(n)
    ref_nll = kl = None
    agree = 0
    if ref_logits is not None:
        ref_nll, kl = np.empty(n), np.empty(n)
    for r0 in range(0, n, ROW_BLOCK):
        r1 = min(n, r0 + ROW_BLOCK)
        rows = np.arange(r1 - r0)
        lp = _log_softmax64(logits[r0:r1])
        nll[r0:r1] = -lp[rows, targets[r0:r1]]
        if ref_logits is not None:
            lq = _log_softmax64(ref_logits[r0:r1])
            ref_nll[r0:r1] = -lq[rows, targets[r0:r1]]
            kl[r0:r1] = np.maximum(0.0, (np.exp(lq) * (lq - lp)).sum(axis=-1))  # rounding can dip below 0
            agree += int((logits[r0:r1].argmax(-1) == ref_logits[r0:r1].argmax(-1)).sum())
    return nll, ref_nll, kl, agree


# ------------------------------------------------------------------------------------------------ reference
def _text_config(config: dict) -> dict:
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config


def check_same_model(manifest, config: dict, label: str, packed_label: str) -> None:
    """SourceError unless `config` describes the same model as the packed `manifest` (architecture, MoE shape,
    vocabulary, attention shapes)."""
    from .archs import architecture_for_config

    arch = architecture_for_config(config)
    if arch.model_type != manifest.model_type:
        raise SourceError(f"reference {label} is a {arch.model_type} model, {packed_label} a {manifest.model_type}",
                          hint="pass --source with the checkpoint or packed model this one was converted from")
    a, b = _text_config(config), _text_config(manifest.config)
    diffs = [f"{k} {a.get(k)} vs {b.get(k)}" for k in _SAME_FIELDS if a.get(k) != b.get(k)]
    if diffs:
        raise SourceError(f"reference {label} is another model than {packed_label}: " + ", ".join(diffs[:4]),
                          hint="pass --source with the checkpoint or packed model this one was converted from")


def _file_digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _check_same_tokenizer(a: Path, b: Path, label: str) -> None:
    da, db = _file_digest(a / "tokenizer.json"), _file_digest(b / "tokenizer.json")
    if da and db and da != db:
        raise SourceError(f"reference {label} has another tokenizer (tokenizer.json differs): the token ids would "
                          "not mean the same", hint="pass --source with the checkpoint this model was converted from")


def _recorded_source(manifest, packed: Path) -> tuple[str, str | None]:
    src = manifest.source or {}
    if src.get("type") == "hub" and src.get("repo_id"):
        return src["repo_id"], src.get("revision")
    path = src.get("path")
    if not path:
        raise SourceError(f"{packed}'s manifest does not say where its source checkpoint is",
                          hint="pass --source SRC (a source checkpoint or a packed model)")
    if not Path(path).is_dir():
        raise SourceError(f"the recorded source {path} of {packed} no longer exists",
                          hint="pass --source SRC (a source checkpoint or a packed model)")
    return path, None


def prepare_reference(packed: Path, manifest, source, stack: ExitStack, *, progress: bool = False):
    """(packed folder of the reference, label). A source checkpoint is packed (bit-exact, its own bits) to a
    temporary folder next to `packed` (removed when `stack` closes) after checking it is the same model."""
    from .layout.constants import MANIFEST_NAME
    from .layout.manifest import load_manifest

    revision = None
    if source is RECORDED or source == "":
        source, revision = _recorded_source(manifest, packed)
    text = os.fspath(source)
    p = Path(text).expanduser()
    if p.is_dir() and (p / MANIFEST_NAME).is_file():
        ref = load_manifest(p)
        check_same_model(manifest, ref.config, p.name, packed.name)
        _check_same_tokenizer(packed, p, p.name)
        return p, p.name
    from .convert import convert
    from .source.checkpoint import open_checkpoint

    ckpt = open_checkpoint(text, revision=revision)  # a folder or a hub repo id; SourceError if neither
    try:
        check_same_model(manifest, ckpt.config, p.name if p.is_dir() else text, packed.name)
        if p.is_dir():
            _check_same_tokenizer(packed, p, p.name)
    finally:
        ckpt.close()
    try:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=".moepack-eval-ref-",
                                                              dir=packed.resolve().parent))
    except OSError:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="moepack-eval-ref-"))
    out = Path(tmp) / "reference"
    convert(text, out, revision=revision, progress=progress)
    return out, (p.name if p.is_dir() else text) + " (packed at its own bits)"


# ------------------------------------------------------------------------------------------------ evaluate
def _bits_label(manifest) -> str:
    bits = sorted({e.bits for e in manifest.layers})
    return "/".join(map(str, bits))


def evaluate(packed: str | os.PathLike, *, text: str | os.PathLike | None = None, source=None,
             max_tokens: int = DEFAULT_MAX_TOKENS, window: int | None = None, backend: str = "auto",
             save: bool = True, progress: bool = False, model=None) -> EvalResult:
    """Perplexity of `packed` on `text` (default: the evaluation text shipped with moepack), and with `source`
    (a packed model, a source checkpoint folder or hub repo id, or RECORDED for the manifest's own source) the
    KL divergence of its next-token distributions from the reference's. `model` reuses a loaded model of
    `packed`. Saves the result in the manifest's eval section when `save`."""
    from .layout.manifest import load_manifest, save_manifest
    from .runtime.generate import resolve_backend
    from .runtime.model import load_model
    from .runtime.tokenizer import TokenizerError, load_tokenizer

    t0 = time.perf_counter()
    packed = Path(packed)
    manifest = load_manifest(packed)
    if max_tokens < 2:
        raise EvalError(f"--max-tokens must be at least 2, got {max_tokens}", hint="e.g. --max-tokens 4096")
    text_path = Path(text) if text is not None else DEFAULT_TEXT
    body, raw = read_text(text_path)
    try:
        tok = load_tokenizer(packed)
    except TokenizerError as e:
        raise EvalError(e.message, hint="eval tokenizes the text with the packed folder's tokenizer.json: copy it "
                                        "from the source checkpoint into the folder") from None
    ids = np.asarray(tok.encode(body, add_special_tokens=False), dtype=np.int64)
    if ids.size > max_tokens:
        raise EvalError(f"{text_path.name} is {ids.size:,} tokens long, more than --max-tokens {max_tokens:,}",
                        hint=f"pass --max-tokens {ids.size} to evaluate all of it (time grows with the length), "
                             "or a shorter --text")
    if ids.size < 2:
        raise EvalError(f"{text_path.name} is only {ids.size} token long: nothing to predict",
                        hint="pass a longer text with --text")
    tc = _text_config(manifest.config)
    vocab = tc.get("vocab_size")
    if isinstance(vocab, int) and int(ids.max()) >= vocab:
        raise EvalError(f"the tokenizer of {packed} gives id {int(ids.max())}, outside the model's vocabulary "
                        f"(0..{vocab - 1})", hint="the folder's tokenizer.json does not belong to this model")
    context = _context(manifest.config, tc)
    if window is None:
        window = min(context or DEFAULT_WINDOW, DEFAULT_WINDOW)
    elif window < 2:
        raise EvalError(f"--window must be at least 2 tokens, got {window}")
    elif context and window > context:
        raise EvalError(f"--window {window} is longer than the model's context ({context} tokens)",
                        hint=f"pass --window {context} or less")
    wins = windows(int(ids.size), window)
    resolved = resolve_backend(backend)

    with ExitStack() as stack:
        if model is None:
            model = stack.enter_context(load_model(packed, backend=resolved))
        ref_model, ref_label = None, None
        if source is not None and source is not False:
            ref_path, ref_label = prepare_reference(packed, manifest, source, stack, progress=progress)
            ref_model = stack.enter_context(load_model(ref_path, backend=resolved))
            if ref_model.vocab_size != model.vocab_size:
                raise SourceError(f"reference {ref_label} has a vocabulary of {ref_model.vocab_size}, "
                                  f"{packed.name} of {model.vocab_size}")
        nlls, kls, ref_nlls, agree = [], [], [], 0
        for w0, w1 in wins:
            cache = model.new_cache()
            ref_cache = ref_model.new_cache() if ref_model is not None else None
            # the whole window is fed (as `moepack run` prefills a prompt, in chunks of FORWARD_CHUNK); position
            # i predicts token i + 1, so the window's last position has nothing to score
            for c0 in range(w0, w1 - 1, FORWARD_CHUNK):
                c1 = min(w1, c0 + FORWARD_CHUNK)
                x = ids[c0:c1]
                targets = ids[c0 + 1:min(c1 + 1, w1)]
                logits = model.forward(x, cache)[:len(targets)]
                ref_logits = ref_model.forward(x, ref_cache)[:len(targets)] if ref_model is not None else None
                nll, ref_nll, kl, a = _score(logits, targets, ref_logits)
                nlls.append(nll)
                if ref_model is not None:
                    ref_nlls.append(ref_nll)
                    kls.append(kl)
                    agree += a
        backend_used = model.backend
        k = model.experts_per_token

    nll = np.concatenate(nlls)
    record = {
        "text": "moepack/data/eval.txt (default)" if text is None else text_path.name,
        "text_sha256": hashlib.sha256(raw).hexdigest(),
        "tokens": int(ids.size),
        "window": int(window),
        "windows": len(wins),
        "scored_tokens": int(nll.size),
        "method": "non-overlapping windows, fresh cache each, first token of each window context only",
        "nll_mean": float(nll.mean()),
        "perplexity": float(math.exp(nll.mean())),
        "experts_bits": _bits_label(manifest),
        "experts_per_token": int(k),
        "backend": backend_used,
        "moepack_version": __version__,
    }
    kl = None
    if ref_label is not None:
        kl = np.concatenate(kls)
        ref_nll = np.concatenate(ref_nlls)
        record.update({
            "reference": ref_label,
            "reference_perplexity": float(math.exp(ref_nll.mean())),
            "kl_mean": float(kl.mean()),
            "kl_p99": float(np.percentile(kl, 99)),
            "kl_max": float(kl.max()),
            "top1_agreement": agree / nll.size,
        })
    res = EvalResult(record, nll, kl, time.perf_counter() - t0)
    if save:
        try:
            m = load_manifest(packed)  # fresh: keep whatever else changed meanwhile
            save_manifest(packed, dataclasses.replace(m, extra={**m.extra, "eval": record}))
            res.saved = True
        except OSError as e:
            res.save_error = f"{e.strerror or e} ({e.filename or packed})"
    return res
