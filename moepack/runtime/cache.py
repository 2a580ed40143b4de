"""Per-layer decoding state, and its exact save/restore for session files.

* Full-attention layers keep a KV cache: keys and values [S, Hkv, hd] float32 in a buffer grown in chunks
  (multiples of ``KVCache.step`` positions, at least +25%), so decode steps rarely reallocate.
* Linear-attention (Gated-DeltaNet) layers keep a fixed-size state: the last Kc-1 conv inputs [Kc-1, C] and
  the recurrent matrix [Hv, dv, dk], both float32.

``Cache.offset`` counts the tokens processed so far (the position of the next token).
``state_dict()`` flattens everything into ``{name: np.ndarray}`` (KV trimmed to ``offset``) and
``Cache.from_state_dict`` rebuilds an equal cache; a session file can store the dict with ``np.savez``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import MoepackError

_KINDS = {"none": 0, "attention": 1, "linear": 2}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}


class KVCache:
    """Keys and values of one full-attention layer."""

    step = 256  # growth granularity in positions; grows by at least a quarter so long contexts copy O(n) in all

    def __init__(self, n_kv_heads: int, head_dim: int):
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.length = 0
        self._k = np.zeros((0, n_kv_heads, head_dim), dtype=np.float32)  # [capacity, Hkv, hd]
        self._v = np.zeros((0, n_kv_heads, head_dim), dtype=np.float32)

    @property
    def capacity(self) -> int:
        return self._k.shape[0]

    @property
    def keys(self) -> np.ndarray:
        return self._k[: self.length]  # [S, Hkv, hd]

    @property
    def values(self) -> np.ndarray:
        return self._v[: self.length]

    def update(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append k, v [T, Hkv, hd]; returns all keys and values so far [S, Hkv, hd] (views)."""
        T = k.shape[0]
        need = self.length + T
        if need > self.capacity:
            cap = max(need, self.capacity + self.capacity // 4)
            cap = (cap + self.step - 1) // self.step * self.step
            for name in ("_k", "_v"):
                old = getattr(self, name)
                new = np.zeros((cap, self.n_kv_heads, self.head_dim), dtype=np.float32)
                new[: self.length] = old[: self.length]
                setattr(self, name, new)
        self._k[self.length : need] = k
        self._v[self.length : need] = v
        self.length = need
        return self.keys, self.values


class LinearState:
    """Conv inputs and recurrent state of one Gated-DeltaNet layer."""

    def __init__(self, conv_kernel: int, conv_dim: int, n_v_heads: int, dv: int, dk: int):
        self.conv = np.zeros((conv_kernel - 1, conv_dim), dtype=np.float32)  # [Kc-1, C]
        self.recurrent = np.zeros((n_v_heads, dv, dk), dtype=np.float32)  # [Hv, dv, dk]


@dataclass(frozen=True)
class LayerSpec:
    """What state a layer keeps: kind 'attention' (n_kv_heads, head_dim), 'linear' (conv_kernel, conv_dim,
    n_v_heads, dv, dk) or 'none'."""

    kind: str
    dims: tuple[int, ...] = ()

    def make(self):
        if self.kind == "attention":
            return KVCache(*self.dims)
        if self.kind == "linear":
            return LinearState(*self.dims)
        return None


class Cache:
    """The decoding state of a whole model: one entry per layer, and the token count ``offset``."""

    def __init__(self, specs: list[LayerSpec]):
        self.specs = list(specs)
        self.layers = [s.make() for s in self.specs]
        self.offset = 0
        # set by a GPU backend's resident decoder while the newest state lives on the device: brings the
        # host arrays up to date; state_dict() (sessions, truncation) calls it first
        self.device_sync = None

    def __len__(self) -> int:
        return len(self.layers)

    # -------------------------------------------------------------------------------------------- save/restore
    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything needed to continue decoding, as arrays (copies)."""
        if self.device_sync is not None:
            self.device_sync()
        d: dict[str, np.ndarray] = {
            "offset": np.array(self.offset, dtype=np.int64),
            "kinds": np.array([_KINDS[s.kind] for s in self.specs], dtype=np.int8),
        }
        for i, (spec, st) in enumerate(zip(self.specs, self.layers)):
            d[f"layer.{i}.dims"] = np.array(spec.dims, dtype=np.int64)
            if spec.kind == "attention":
                d[f"layer.{i}.keys"] = st.keys.copy()
                d[f"layer.{i}.values"] = st.values.copy()
            elif spec.kind == "linear":
                d[f"layer.{i}.conv"] = st.conv.copy()
                d[f"layer.{i}.recurrent"] = st.recurrent.copy()
        return d

    @classmethod
    def from_state_dict(cls, state: dict[str, np.ndarray]) -> "Cache":
        """The cache `state_dict()` described; raises MoepackError when the dict is inconsistent."""
        bad = "the saved model state is damaged or from another version"
        try:
            offset = int(np.asarray(state["offset"]))
            kinds = [int(k) for k in np.asarray(state["kinds"]).reshape(-1)]
            specs = [LayerSpec(_KIND_NAMES[k], tuple(int(x) for x in np.asarray(state[f"layer.{i}.dims"]).reshape(-1)))
                     for i, k in enumerate(kinds)]
        except (KeyError, TypeError, ValueError) as e:
            raise MoepackError(f"saved cache lacks or garbles {e}", hint=bad) from None
        cache = cls(specs)
        cache.offset = offset
        for i, (spec, st) in enumerate(zip(specs, cache.layers)):
            try:
                if spec.kind == "attention":
                    k = np.asarray(state[f"layer.{i}.keys"], dtype=np.float32)
                    v = np.asarray(state[f"layer.{i}.values"], dtype=np.float32)
                    want = (offset,) + spec.dims
                    if k.shape != want or v.shape != want:
                        raise MoepackError(f"saved cache layer {i}: keys {k.shape} / values {v.shape}, expected {want}",
                                           hint=bad)
                    st.update(k, v)
                elif spec.kind == "linear":
                    conv = np.asarray(state[f"layer.{i}.conv"], dtype=np.float32)
                    rec = np.asarray(state[f"layer.{i}.recurrent"], dtype=np.float32)
                    if conv.shape != st.conv.shape or rec.shape != st.recurrent.shape:
                        raise MoepackError(f"saved cache layer {i}: conv {conv.shape} / state {rec.shape}, expected "
                                           f"{st.conv.shape} / {st.recurrent.shape}", hint=bad)
                    st.conv[...] = conv
                    st.recurrent[...] = rec
            except KeyError as e:
                raise MoepackError(f"saved cache lacks {e}", hint=bad) from None
        return cache

    def check_compatible(self, specs: list[LayerSpec]) -> None:
        """Raise MoepackError unless this cache has the layer layout `specs` (the model's)."""
        if list(specs) != self.specs:
            raise MoepackError("this cache (or saved session) belongs to a model with another layer layout",
                               hint="start a new session for this model")

    @property
    def nbytes(self) -> int:
        n = 0
        for st in self.layers:
            if isinstance(st, KVCache):
                n += st.keys.nbytes + st.values.nbytes
            elif isinstance(st, LinearState):
                n += st.conv.nbytes + st.recurrent.nbytes
        return n
