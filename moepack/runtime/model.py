"""The runtime's public entry point: load a packed model, run tokens through it.

    model = load_model("packed/", backend="numpy")
    cache = model.new_cache()
    logits = model.forward(np.array(prompt_ids), cache)     # prefill: [T, vocab]
    logits = model.forward(np.array([next_id]), cache)      # decode: [1, vocab]

The dense part is memory-mapped (``DenseWeights``); routed experts are read from the packed layer files
per layer as the router picks them (``ExpertReader``), each needed expert once per forward call, applied
to every token routed to it. ``backend`` picks the kernel module all model code calls through.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

from ..errors import MoepackError
from ..layout.reader import PackedModel
from .cache import Cache
from .io import ExpertReader, default_io
from .models import get_model_module
from .models.common import Ctx, LayerTimes
from .weights import DenseWeights

BACKENDS = {"numpy": "kernels_ref", "numba": "kernels_numba"}
KERNELS = ("qmatmul", "expert_ffn", "rmsnorm", "gated_rmsnorm", "rope", "attention", "conv1d_step",
           "gated_delta", "router_topk", "qembedding")


GPU_BACKENDS = ("metal-emu", "cuda", "metal")  # the metal/*.metal kernels on one of their executors
ENV_RESIDENT = "MOEPACK_RESIDENT"  # "0": GPU backends decode through the kernel-module path (no resident step)


def load_kernels(backend: str) -> ModuleType:
    """The kernel module of `backend` ('numpy' -> kernels_ref, 'numba' -> kernels_numba), imported lazily;
    'metal-emu' / 'cuda' / 'metal': a GpuKernels object (same functions) over that executor."""
    if backend in GPU_BACKENDS:
        from .metal.executors import make_executor
        from .metal.backend import GpuKernels

        return GpuKernels(make_executor(backend))  # type: ignore[return-value]
    mod = BACKENDS.get(backend)
    if mod is None:
        raise MoepackError(f"unknown backend {backend!r}", hint=f"use one of {', '.join(BACKENDS)}")
    full = f"{__package__}.{mod}"
    try:
        module = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name != full:
            raise
        raise MoepackError(f"backend {backend!r} is not available in this moepack ({full} is missing)",
                           hint="use backend='numpy'") from None
    missing = [k for k in KERNELS if not callable(getattr(module, k, None))]
    if missing:
        raise MoepackError(f"backend {backend!r} lacks kernels {', '.join(missing)}", hint="use backend='numpy'")
    return module


@dataclass
class RuntimeStats:
    """Counters since load (or the last reset()). Times are wall-clock seconds."""

    expert_bytes_read: int = 0
    experts_read: int = 0
    io_wait_s: float = 0.0  # blocked waiting for expert reads
    compute_s: float = 0.0  # forward time not spent waiting for reads
    tokens: int = 0
    forward_calls: int = 0
    layers: dict[int, LayerTimes] = field(default_factory=dict)  # per layer: attn_s, moe_s, io_wait_s, ...

    def reset(self) -> None:
        self.expert_bytes_read = self.experts_read = self.tokens = self.forward_calls = 0
        self.io_wait_s = self.compute_s = 0.0
        self.layers.clear()  # the dict object is shared with the run context: clear, do not replace

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "layers"}
        d["layers"] = {str(i): asdict(t) for i, t in sorted(self.layers.items())}
        return d


class Model:
    """A loaded packed model. Not thread-safe: one forward at a time."""

    def __init__(self, packed: PackedModel, *, backend: str = "numpy", io: str = "pread",
                 experts_per_token: int | None = None, io_threads: int = 4, owns_packed: bool = False,
                 io_split: int = 1):
        self.K = load_kernels(backend)
        self.backend = backend
        self.packed = packed
        self._owns_packed = owns_packed  # close() closes the PackedModel only when load_model opened it
        self.manifest = packed.manifest
        config = self.manifest.config
        self.arch = get_model_module(self.manifest.model_type)
        self.text_config: dict = self.arch.text_config(config)
        self.args = self.arch.parse_args(config)
        k = experts_per_token or self.manifest.moe.experts_per_token
        if not 1 <= k <= self.manifest.moe.num_experts:
            raise MoepackError(f"experts_per_token={k} is outside 1..{self.manifest.moe.num_experts}")
        self.experts_per_token = k
        self.weights = DenseWeights(packed.path, config)
        try:
            self.decoder = self.arch.build(self.weights, packed, self.args)
            self.reader = ExpertReader(packed, io=io, threads=io_threads, split=io_split,
                                       auto_default=default_io(backend, packed.manifest.expert_bytes_total))
        except BaseException:
            self.weights.close()
            raise
        self.vocab_size: int = self.decoder.lm_head.out_features
        self.eos_token_ids: list[int] = _eos_ids(packed.path, config, self.text_config)
        self.stats = RuntimeStats()
        self._ctx = Ctx(K=self.K, reader=self.reader, top_k=k, times=self.stats.layers)
        self._specs = self.decoder.layer_specs()
        # GPU backends: decode steps run device-resident (metal/resident.py) unless MOEPACK_RESIDENT=0
        self.use_resident = backend in GPU_BACKENDS and os.environ.get(ENV_RESIDENT, "1") != "0"
        self.resident = None  # the ResidentDecoder, made at the first decode step
        self.resident_error: str | None = None  # why the model has none (then decode keeps the kernel-module path)

    def new_cache(self) -> Cache:
        return Cache(self._specs)

    @property
    def expert_batch(self) -> int:
        """Experts per read request when a forward call needs many (prefill). Two requests are in flight at
        most, so expert read buffers stay under 2 * expert_batch records; decode (K experts) is one request."""
        return self._ctx.expert_batch

    @expert_batch.setter
    def expert_batch(self, n: int) -> None:
        if n < 1:
            raise MoepackError(f"expert_batch must be at least 1, got {n}")
        self._ctx.expert_batch = int(n)

    def forward(self, ids, cache: Cache) -> np.ndarray:
        """ids int [T] -> logits f32 [T, vocab]. Positions continue from cache.offset; cache updated in place.

        If the call raises part way (e.g. an I/O error), the cache is left inconsistent: start a new one or
        restore a saved state_dict. On a GPU backend one-token calls run device-resident and leave the newest
        state on the device: call ``sync_cache(cache)`` before reading the cache's arrays (``state_dict``)."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise MoepackError(f"forward expects a non-empty 1-D array of token ids, got {ids.dtype} {ids.shape}")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise MoepackError(f"token id {int(bad[0])} is outside the vocabulary (0..{self.vocab_size - 1})",
                               hint="the ids come from another tokenizer than this model's")
        cache.check_compatible(self._specs)
        io0, bytes0, reads0 = self.reader.stats.wait_s, self.reader.stats.bytes_read, self.reader.stats.reads
        t0 = time.perf_counter()
        resident = self._resident() if ids.size == 1 else None
        if resident is not None:
            logits = resident.step(int(ids[0]), cache)
        else:
            if self.resident is not None:  # the host cache is about to change: bring it up to date first
                self.resident.sync(cache, release=True)
            logits = self.decoder.forward(self._ctx, ids.astype(np.int64), cache)
        wall = time.perf_counter() - t0
        io = self.reader.stats.wait_s - io0
        s = self.stats
        s.io_wait_s += io
        s.compute_s += wall - io
        s.expert_bytes_read += self.reader.stats.bytes_read - bytes0
        s.experts_read += self.reader.stats.reads - reads0
        s.tokens += ids.size
        s.forward_calls += 1
        return logits

    def _resident(self):
        if not self.use_resident or self.resident_error is not None:
            return None
        if self.resident is None:
            from .metal.resident import make_resident

            self.resident = make_resident(self)
        return self.resident

    def sync_cache(self, cache: Cache) -> None:
        """Bring `cache`'s host arrays up to date when decode steps left its newest state on the device
        (before saving it, e.g. a session); a no-op otherwise."""
        if self.resident is not None:
            self.resident.sync(cache)

    def close(self) -> None:
        self.reader.close()
        self.weights.close()
        if self._owns_packed:
            self.packed.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_model(packed, *, backend: str = "numpy", io: str = "pread", experts_per_token: int | None = None,
               io_threads: int = 4, io_split: int = 1) -> Model:
    """Open a packed model folder (or a PackedModel) for inference. `io`: one of runtime.io.IO_CHOICES
    ('pread', 'direct', 'mmap', 'hybrid', 'auto'), optionally 'MODE:N' for split reads of N chunks."""
    owns = not isinstance(packed, PackedModel)
    pm = PackedModel(packed) if owns else packed
    try:
        return Model(pm, backend=backend, io=io, experts_per_token=experts_per_token, io_threads=io_threads,
                     owns_packed=owns, io_split=io_split)
    except BaseException:
        if owns:
            pm.close()
        raise


def _eos_ids(path: os.PathLike, config: dict, text_config: dict) -> list[int]:
    """End-of-sequence ids from config.json (text and outer) and generation_config.json, in that order."""
    found: list[int] = []

    def add(v):
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(x, int) and not isinstance(x, bool) and x not in found:
                found.append(x)

    add(text_config.get("eos_token_id"))
    add(config.get("eos_token_id"))
    try:
        gen = json.loads(Path(path, "generation_config.json").read_text())
    except (OSError, ValueError):
        gen = None
    if isinstance(gen, dict):
        add(gen.get("eos_token_id"))
    return found
