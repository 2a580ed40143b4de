#!/usr/bin/env python3
"""Train the tiny ``qwen3_5_moe`` model that ships in ``moepack/data/tiny-qwen35-moe/`` (not run in CI).

What it does, deterministically for a given Python version (the corpus is that Python's own standard library):

1. reads a fixed list of standard-library ``.py`` files from ``sysconfig.get_paths()['stdlib']`` (the training
   text) and writes ``moepack/data/eval.txt`` from held-out files that are *not* in that list;
2. trains a byte-level BPE tokenizer on the training text with the ``tokenizers`` library (special tokens
   ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` at ids 0, 1, 2);
3. builds mlx-lm's own ``qwen3_5_moe`` model class from a config.json dict and trains it on CPU with mlx:
   next-token cross-entropy plus a small Switch-style load-balancing loss on every router, AdamW, warm-up
   and cosine learning-rate decay, gradient clipping. Batches are random windows of the token stream drawn
   from a generator seeded by (seed, step), so a resumed run sees the same batches as an uninterrupted one;
4. saves a resumable checkpoint (float32 weights + optimizer state) every ``--save-every`` steps;
5. writes the result the way ``mlx_lm.convert -q`` does: weights cast to bf16 (A_log stays float32, mlx-lm's
   cast_predicate), quantized with mlx-lm's quantizer at 4 bits / group 64 (routers at 8 bits, the model's
   quant_predicate), saved with mlx-lm's ``save_model``/``save_config``; plus tokenizer files with the chat
   template and a ``SHA256SUMS``.

Training speed: mlx's gated-delta recurrence on CPU is a Python loop over time steps; for training this
script swaps in a chunked (parallel within 64-token chunks) form of the same recurrence, checked against
mlx-lm's at start-up (``--self-check`` does only that). The model code is otherwise mlx-lm's, unchanged, and
the saved checkpoint is a plain mlx-lm checkpoint.

On Linux, the ``mlx[cpu]`` wheel links the reference (netlib) BLAS, ~40x slower at matrix products than
OpenBLAS. If an OpenBLAS is installed (Debian/Ubuntu: ``apt-get install libopenblas0-pthread``) this script
re-executes itself with it preloaded (``--no-openblas`` turns that off); the results are the same up to
floating-point rounding.

Usage (about 20 minutes on a shared 2-core machine):

    python scripts/train_tiny.py                       # train, write moepack/data/tiny-qwen35-moe/
    python scripts/train_tiny.py --resume              # continue an interrupted run from its last checkpoint
    python scripts/train_tiny.py --self-check          # only compare the chunked recurrence with mlx-lm's
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "moepack" / "data" / "tiny-qwen35-moe"
DEFAULT_EVAL = ROOT / "moepack" / "data" / "eval.txt"
DEFAULT_WORK = ROOT / "build" / "tiny-train"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
                          r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# The training text: standard-library modules present (under one of the listed names) in CPython 3.10-3.13.
TRAIN_FILES = [
    "abc.py", "argparse.py", "ast.py", "base64.py", "bdb.py", "bisect.py", "calendar.py", "cmd.py", "codecs.py",
    "codeop.py", "collections/__init__.py", "colorsys.py", "compileall.py", "configparser.py", "contextlib.py",
    "copy.py", "copyreg.py", "csv.py", "dataclasses.py", "difflib.py", "dis.py", "enum.py", "filecmp.py",
    "fileinput.py", "fnmatch.py", "fractions.py", "ftplib.py", "functools.py", "genericpath.py", "getopt.py",
    "gettext.py", "glob.py", "gzip.py", "hashlib.py", "heapq.py", "hmac.py", "imaplib.py", "inspect.py",
    "ipaddress.py", "keyword.py", "linecache.py", "locale.py", "mailbox.py", "mimetypes.py", "modulefinder.py",
    "netrc.py", "ntpath.py", "numbers.py", "opcode.py", "operator.py", "optparse.py", "os.py", "pdb.py",
    "pickle.py", "pkgutil.py", "platform.py", "plistlib.py", "poplib.py", "posixpath.py", "pprint.py",
    "profile.py", "pstats.py", "py_compile.py", "pyclbr.py", "queue.py", "quopri.py", "random.py", "reprlib.py",
    "rlcompleter.py", "runpy.py", "sched.py", "secrets.py", "selectors.py", "shelve.py", "shlex.py",
    "shutil.py", "signal.py", "site.py", "smtplib.py", "socket.py", "socketserver.py", "ssl.py", "stat.py",
    "statistics.py", "string.py", "stringprep.py", "struct.py", "subprocess.py", "symtable.py", "tabnanny.py",
    "tarfile.py", "tempfile.py", "threading.py", "timeit.py", "token.py", "tokenize.py", "trace.py",
    "traceback.py", "tracemalloc.py", "types.py", "typing.py", "uuid.py", "warnings.py", "wave.py",
    "weakref.py", "webbrowser.py", "zipapp.py", "zipimport.py",
    ("zipfile.py", "zipfile/__init__.py"), ("pathlib.py", "pathlib/__init__.py"),
    "json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py", "json/tool.py",
    "logging/__init__.py", "logging/config.py", "logging/handlers.py",
    "unittest/case.py", "unittest/loader.py", "unittest/main.py", "unittest/mock.py", "unittest/result.py",
    "unittest/runner.py", "unittest/suite.py", "unittest/util.py",
    "email/message.py", "email/utils.py", "email/parser.py", "email/feedparser.py", "email/header.py",
    "http/client.py", "http/cookies.py", "http/server.py", "urllib/parse.py", "urllib/request.py",
    "urllib/robotparser.py", "xml/dom/minidom.py", "xml/etree/ElementTree.py", "html/parser.py",
    "concurrent/futures/_base.py", "concurrent/futures/thread.py", "concurrent/futures/process.py",
    "asyncio/base_events.py", "asyncio/events.py", "asyncio/futures.py", "asyncio/locks.py",
    "asyncio/queues.py", "asyncio/streams.py", "asyncio/tasks.py", "importlib/__init__.py",
    "importlib/abc.py", "importlib/util.py", "sqlite3/__init__.py", "sqlite3/dump.py", "wsgiref/simple_server.py",
    "wsgiref/handlers.py", "wsgiref/util.py", "xmlrpc/client.py", "xmlrpc/server.py", "curses/textpad.py",
    "dbm/__init__.py", "dbm/dumb.py", "multiprocessing/pool.py", "multiprocessing/queues.py",
    "multiprocessing/managers.py", "ctypes/__init__.py",
]
# Held out (never trained on): the evaluation text that ships as moepack/data/eval.txt.
EVAL_FILES = ["textwrap.py", "graphlib.py", "contextvars.py", "this.py"]
EVAL_CHARS = 6000

# Model: qwen3_5_moe text config (mlx-lm 0.32 reads these fields).
MODEL = dict(
    hidden_size=128, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
CONTEXT = 256
CHUNK = 32  # chunk length of the chunked gated-delta recurrence used in training
VOCAB = 2048

CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


# ------------------------------------------------------------------------------------------------ corpus
def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_files(names, *, required: bool) -> list[tuple[str, str]]:
    base = stdlib_dir()
    out = []
    for item in names:
        alts = item if isinstance(item, tuple) else (item,)
        for rel in alts:
            p = base / rel
            if p.is_file():
                out.append((rel, p.read_text(encoding="utf-8")))
                break
        else:
            if required:
                raise SystemExit(f"{alts[0]} is missing from {base}")
            print(f"note: {alts[0]} not in this Python's stdlib; skipped", flush=True)
    return out


def chat_samples(files: list[tuple[str, str]], limit_chars: int) -> list[str]:
    """Chat-formatted examples (user: a function's docstring summary, assistant: the function's code), so the
    chat template is something the model has seen. Deterministic: files in order, functions in source order."""
    samples, total = [], 0
    for _, text in files:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.col_offset != 0:
                continue
            doc = ast.get_docstring(node)
            src = ast.get_source_segment(text, node)
            if not doc or not src or len(src) > 1500:
                continue
            ask = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if not 10 <= len(ask) <= 300:
                continue
            s = f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n{src}<|im_end|>\n"
            samples.append(s)
            total += len(s)
            if total >= limit_chars:
                return samples
    return samples


def build_corpus() -> tuple[list[str], str, dict]:
    files = read_files(TRAIN_FILES, required=False)
    docs = [text for _, text in files]
    code_chars = sum(map(len, docs))
    chats = chat_samples(files, limit_chars=code_chars // 12)
    held = read_files(EVAL_FILES, required=False)
    eval_text = ""
    for _, text in held:
        eval_text += text if not eval_text else "\n\n" + text
        if len(eval_text) >= EVAL_CHARS:
            break
    cut = eval_text.rfind("\n", 0, EVAL_CHARS)  # whole lines, a few KB
    eval_text = eval_text[: cut + 1 if cut > 0 else EVAL_CHARS]
    info = {"python": sys.version.split()[0], "stdlib": str(stdlib_dir()), "train_files": len(files),
            "code_chars": code_chars, "chat_samples": len(chats), "chat_chars": sum(map(len, chats)),
            "eval_files": [n for n, _ in held], "eval_chars": len(eval_text)}
    return docs + chats, eval_text, info


def train_tokenizer(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # Qwen's byte-level BPE pipeline (what transformers' Qwen3_5Tokenizer builds for this model_type, whatever
    # tokenizer.json says): NFC, split with Qwen's regex, bytes to unicode; so mlx-lm/transformers and
    # tokenizer.json give the same ids
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, s
    return tok


def tokenize_stream(tok, texts: list[str]) -> np.ndarray:
    """All texts as one id stream, each followed by <|endoftext|>."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(0)
    return np.asarray(ids, dtype=np.int32)


# ------------------------------------------------------------------------------------------------ model config
def model_config(vocab_size: int) -> dict:
    text = {
        "model_type": "qwen3_5_moe_text", **MODEL, "vocab_size": vocab_size,
        "max_position_embeddings": CONTEXT, "attention_bias": False, "hidden_act": "silu",
        "layer_types": ["linear_attention" if (i + 1) % MODEL["full_attention_interval"] else "full_attention"
                        for i in range(MODEL["num_hidden_layers"])],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        "bos_token_id": 0, "eos_token_id": 2, "dtype": "bfloat16",
    }
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False, "text_config": text}


# ------------------------------------------------------------------------------------------------ chunked recurrence
def chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
                               lower_bound=None, allow_neg_eigval=False, chunk=CHUNK):
    """mlx-lm's gated_delta_update (scalar gate, no mask), computed chunk-parallel.

    Within a chunk with state S0 and cumulative log-decay L (gamma = exp(L)), the recurrence
    S_t = g_t S_{t-1} + u_t k_t^T, u_t = beta_t (v_t - g_t S_{t-1} k_t) gives (I + A) U = diag(beta)(V - diag(gamma) K S0^T)
    with A_ts = beta_t exp(L_t - L_s) k_t.k_s (s < t); (I + A)^-1 is the finite product (I - A)(I + A^2)(I + A^4)...
    (A is nilpotent). Then Y = diag(gamma) Q S0^T + tril(Q K^T * exp(L_t - L_s)) U and
    S_C = gamma_C S0 + U^T diag(exp(L_C - L)) K.
    """
    import mlx.core as mx
    import mlx.nn as nn

    assert mask is None and lower_bound is None and not allow_neg_eigval
    beta = mx.sigmoid(b)
    logg = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)  # log of mlx-lm's compute_g
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    C = min(chunk, T)
    N = -(-T // C)
    pad = N * C - T
    if pad:
        z = lambda x: mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        q, k, v, beta, logg = z(q), z(k), z(v), z(beta), z(logg)

    def heads_first(x):  # [B, N*C, H, D] -> [B, H, N, C, D]
        return x.reshape(B, N, C, Hv, -1).transpose(0, 3, 1, 2, 4)

    qc, kc, vc = heads_first(q), heads_first(k), heads_first(v)
    betac = beta.reshape(B, N, C, Hv).transpose(0, 3, 1, 2)  # [B, H, N, C]
    L = mx.cumsum(logg.reshape(B, N, C, Hv).transpose(0, 3, 1, 2), axis=-1)
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), -1)
    incl = mx.tril(mx.ones((C, C), dtype=mx.bool_), 0)
    diff = L[..., :, None] - L[..., None, :]
    decay = mx.exp(mx.where(incl, diff, -mx.inf))  # exp(L_t - L_s), s <= t; 0 above the diagonal
    A = mx.where(strict, betac[..., :, None] * decay * (kc @ kc.swapaxes(-1, -2)), 0.0)
    eye = mx.eye(C, dtype=A.dtype)
    inv = eye - A
    p = A
    for _ in range(max(0, math.ceil(math.log2(C)) - 1)):
        p = p @ p
        inv = inv + inv @ p  # inv @ (I + p)
    gamma = mx.exp(L)
    W = inv @ ((betac * gamma)[..., None] * kc)  # [B, H, N, C, Dk]
    Ut = inv @ (betac[..., None] * vc)  # [B, H, N, C, Dv]
    QK = (qc @ kc.swapaxes(-1, -2)) * decay  # [B, H, N, C, C] (lower triangular)
    tail = mx.exp(L[..., -1:] - L)  # [B, H, N, C]
    S = state
    ys = []
    for n in range(N):
        St = S.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        U = Ut[:, :, n] - W[:, :, n] @ St
        y = gamma[:, :, n, :, None] * (qc[:, :, n] @ St) + QK[:, :, n] @ U
        ys.append(y)
        S = gamma[:, :, n, -1, None, None] * S + (U * tail[:, :, n, :, None]).swapaxes(-1, -2) @ kc[:, :, n]
    y = mx.stack(ys, axis=2)  # [B, H, N, C, Dv]
    y = y.transpose(0, 2, 3, 1, 4).reshape(B, N * C, Hv, Dv)[:, :T]
    return y.astype(q.dtype), S


def self_check() -> None:
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    mx.random.seed(0)
    for B, T, Hk, Hv, D, chunk in [(2, 200, 2, 4, 64, 64), (1, 37, 1, 2, 32, 16)]:
        q = mx.random.normal((B, T, Hk, D))
        k = mx.random.normal((B, T, Hk, D))
        q, k = normalize_qk(q, k, inv_scale=D ** -0.5, eps=1e-6)
        v = mx.random.normal((B, T, Hv, D))
        a, b = mx.random.normal((B, T, Hv)), mx.random.normal((B, T, Hv))
        A_log, dt_bias = mx.log(mx.random.uniform(1, 16, (Hv,))), mx.ones(Hv)
        s0 = 0.1 * mx.random.normal((B, Hv, D, D))
        y_ref, s_ref = gated_delta_update(q, k, v, a, b, A_log, dt_bias, s0, use_kernel=False)
        y, s = chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, s0, chunk=chunk)
        ey = float(mx.abs(y - y_ref).max()) / float(mx.abs(y_ref).max())
        es = float(mx.abs(s - s_ref).max()) / float(mx.abs(s_ref).max())
        print(f"chunked gated delta vs mlx-lm (B={B} T={T} chunk={chunk}): max rel err y {ey:.2e} state {es:.2e}")
        assert ey < 1e-4 and es < 1e-4, "chunked recurrence disagrees with mlx-lm's"


# ------------------------------------------------------------------------------------------------ training
AUX: list = []


def patch_mlx_lm(aux_coef: float) -> None:
    """Chunked recurrence for training, and the routers' load-balancing loss collected on the side."""
    import mlx.core as mx
    from mlx_lm.models import qwen3_5, qwen3_next

    qwen3_5.gated_delta_update = chunked_gated_delta_update
    block = qwen3_next.Qwen3NextSparseMoeBlock

    def moe_call(self, x):  # mlx-lm's Qwen3NextSparseMoeBlock.__call__ plus the Switch-Transformer aux loss
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = (self.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)
        y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if aux_coef and self.training:
            E = self.num_experts
            frac = mx.stop_gradient((inds[..., None] == mx.arange(E)).astype(mx.float32).mean(axis=(0, 1, 2)))
            prob = gates.reshape(-1, E).mean(axis=0)
            AUX.append(E * (frac * prob).sum())
        return y

    block.__call__ = moe_call


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def batch(stream: np.ndarray, step: int, args) -> np.ndarray:
    rng = np.random.default_rng([args.seed, step])
    starts = rng.integers(0, len(stream) - CONTEXT - 1, size=args.batch)
    return np.stack([stream[s: s + CONTEXT + 1] for s in starts])


def save_ckpt(work: Path, model, opt, step: int, log: list) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    tmp = work / "ckpt.tmp.safetensors"
    flat = {f"model.{k}": v for k, v in tree_flatten(model.parameters())}
    flat.update({f"opt.{k}": v for k, v in tree_flatten(opt.state)})
    mx.save_safetensors(str(tmp), flat)
    os.replace(tmp, work / "ckpt.safetensors")
    (work / "ckpt.json.tmp").write_text(json.dumps({"step": step, "log": log}))
    os.replace(work / "ckpt.json.tmp", work / "ckpt.json")


def load_ckpt(work: Path, model, opt):
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    flat = mx.load(str(work / "ckpt.safetensors"))
    model.update(tree_unflatten([(k[6:], v) for k, v in flat.items() if k.startswith("model.")]))
    opt.state = tree_unflatten([(k[4:], v) for k, v in flat.items() if k.startswith("opt.")])
    meta = json.loads((work / "ckpt.json").read_text())
    return meta["step"], meta["log"]


def eval_loss(model, ids: np.ndarray) -> float:
    import mlx.core as mx
    import mlx.nn as nn

    model.eval()
    tot, n = 0.0, 0
    for s in range(0, len(ids) - 1, CONTEXT):
        w = ids[s: s + CONTEXT + 1]
        if len(w) < 2:
            break
        x = mx.array(w[None, :-1])
        logits = model(x).astype(mx.float32)
        l = nn.losses.cross_entropy(logits, mx.array(w[None, 1:]), reduction="sum")
        tot += float(l)
        n += len(w) - 1
    model.train()
    return tot / n


def write_tokenizer_files(out: Path, tok) -> None:
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, s in enumerate(SPECIAL_TOKENS)}
    tokenizer_config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
        "errors": "replace", "model_max_length": CONTEXT, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None,
    }
    (out / "tokenizer.json").write_text(tok.to_str(pretty=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0}, indent=2) + "\n")


def export(model, config: dict, tok, out: Path, bits: int) -> None:
    """bf16 cast + mlx-lm quantization + mlx-lm savers: what mlx_lm.convert -q writes."""
    import contextlib
    import io

    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import quantize_model, save_config, save_model

    model.eval()
    cast = model.cast_predicate
    model.update(tree_map_with_path(
        lambda p, v: v.astype(mx.bfloat16) if cast(p) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))
    config = copy.deepcopy(config)
    with contextlib.redirect_stdout(io.StringIO()):
        model, config = quantize_model(model, config, 64, bits, quant_predicate=model.quant_predicate)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.iterdir()):
        if old.is_file():
            old.unlink()
    save_model(out, model)
    (out / "model.safetensors.index.json").unlink()  # single file; mlx-lm and moepack read it without an index
    save_config(config, config_path=out / "config.json")
    write_tokenizer_files(out, tok)
    sums = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in sorted(out.iterdir())
            if p.is_file() and p.name != "SHA256SUMS"]
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")


def maybe_reexec_with_openblas(args) -> None:
    if args.no_openblas or sys.platform != "linux" or os.environ.get("MOEPACK_TRAIN_REEXEC"):
        return
    for cand in ("/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
                 "/usr/lib64/libopenblas.so.0", "/usr/lib/libopenblas.so.0"):
        if os.path.exists(cand):
            env = dict(os.environ, MOEPACK_TRAIN_REEXEC="1",
                       LD_PRELOAD=(cand + " " + os.environ.get("LD_PRELOAD", "")).strip())
            env.setdefault("OPENBLAS_NUM_THREADS", "1")
            print(f"re-running with {cand} preloaded (mlx[cpu] on Linux links the slow reference BLAS)", flush=True)
            os.execve(sys.executable, [sys.executable] + sys.argv, env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--eval-out", type=Path, default=DEFAULT_EVAL)
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK, help="checkpoints, logs (resumable)")
    ap.add_argument("--steps", type=int, default=720)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="stop (checkpoint saved, export done) after this long even if steps remain")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--self-check", action="store_true")
    ap.add_argument("--no-openblas", action="store_true")
    args = ap.parse_args()
    maybe_reexec_with_openblas(args)

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    mx.set_default_device(mx.cpu)
    self_check()
    if args.self_check:
        return

    t0 = time.time()
    texts, eval_text, info = build_corpus()
    tok = train_tokenizer(texts)
    stream = tokenize_stream(tok, texts)
    eval_ids = np.asarray(tok.encode(eval_text, add_special_tokens=False).ids, dtype=np.int32)
    info.update(tokens=int(stream.size), eval_tokens=int(eval_ids.size), vocab=tok.get_vocab_size(),
                corpus_sha256=hashlib.sha256("\0".join(texts).encode()).hexdigest())
    print(json.dumps(info), flush=True)
    args.eval_out.parent.mkdir(parents=True, exist_ok=True)
    args.eval_out.write_text(eval_text, encoding="utf-8")

    config = model_config(tok.get_vocab_size())
    mx.random.seed(args.seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {n_params:,} parameters; {args.steps} steps x {args.batch} x {CONTEXT} tokens "
          f"= {args.steps * args.batch * CONTEXT:,} tokens ({args.steps * args.batch * CONTEXT / stream.size:.2f} "
          "epochs)", flush=True)
    patch_mlx_lm(args.aux_coef)
    model.train()
    opt = optim.AdamW(learning_rate=args.lr, betas=[0.9, 0.95], weight_decay=args.weight_decay)

    def loss_fn(m, x, y):
        AUX.clear()
        ce = nn.losses.cross_entropy(m(x), y).mean()
        aux = sum(AUX) / len(AUX) if AUX else mx.array(0.0)
        return ce + args.aux_coef * aux, (ce, aux)

    value_and_grad = nn.value_and_grad(model, loss_fn)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    start, log = 0, []
    if args.resume and (args.work_dir / "ckpt.json").exists():
        start, log = load_ckpt(args.work_dir, model, opt)
        print(f"resumed at step {start}", flush=True)
    t_train = time.time()
    step = start
    for step in range(start, args.steps):
        opt.learning_rate = lr_at(step, args)
        xy = batch(stream, step, args)
        (loss, (ce, aux)), grads = value_and_grad(model, mx.array(xy[:, :-1]), mx.array(xy[:, 1:]))
        grads, gnorm = optim.clip_grad_norm(grads, args.clip)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, ce, aux)
        rec = {"step": step + 1, "loss": round(float(ce), 4), "aux": round(float(aux), 4),
               "lr": round(opt.learning_rate.item(), 6), "gnorm": round(float(gnorm), 3),
               "elapsed_s": round(time.time() - t_train, 1)}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            rec["eval_loss"] = round(eval_loss(model, eval_ids), 4)
        log.append(rec)
        if (step + 1) % 10 == 0 or "eval_loss" in rec:
            tps = (step + 1 - start) * args.batch * CONTEXT / (time.time() - t_train)
            print(json.dumps({**rec, "tok_s": round(tps)}), flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save_ckpt(args.work_dir, model, opt, step + 1, log)
        if args.max_minutes and time.time() - t_train > 60 * args.max_minutes:
            save_ckpt(args.work_dir, model, opt, step + 1, log)
            print(f"stopping after {args.max_minutes} minutes at step {step + 1}", flush=True)
            break
    (args.work_dir / "train_log.json").write_text(json.dumps({"info": info, "args": {
        k: str(v) for k, v in vars(args).items()}, "params": n_params, "log": log}, indent=1))
    final_eval = eval_loss(model, eval_ids)
    print(f"final held-out loss (float32, mlx-lm): {final_eval:.4f} (perplexity {math.exp(final_eval):.2f}); "
          f"training {time.time() - t_train:.0f} s, total {time.time() - t0:.0f} s", flush=True)
    export(model, config, tok, args.out, args.bits)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB) and {args.eval_out}", flush=True)


if __name__ == "__main__":
    main()
