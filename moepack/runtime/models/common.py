"""What the Qwen MoE architectures share: arguments, linear layers, full attention, the MoE block, the
decoder skeleton.

Every numeric kernel is called through ``ctx.K``, the backend's kernel module (``kernels_ref`` or
``kernels_numba``), so all backends run this same code; only cheap elementwise glue is plain numpy here.

Shape legend: T = tokens of this call, D = hidden, E = routed experts, k = experts per token,
Hq/Hkv = attention heads, hd = head dim, I = expert intermediate, V = vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import MoepackError, PackedModelError, ShapeError
from ..cache import Cache, KVCache, LayerSpec
from ..weights import DenseWeights, FloatLinear, QLinear

# ------------------------------------------------------------------------------------------------ arguments


@dataclass(frozen=True)
class LinearAttnArgs:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int  # dk
    head_v_dim: int  # dv
    conv_kernel: int  # Kc


@dataclass(frozen=True)
class TextArgs:
    """The language-model fields the runtime needs, parsed leniently from config.json, frozen afterwards."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int  # leading dims of each head that RoPE turns
    rope_position_scale: float  # 1/factor for linear RoPE scaling, else 1
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    intermediate_size: int  # dense-MLP layers
    attention_output_gate: bool  # q_proj also yields a sigmoid gate on the attention output (Qwen3-Next/3.5)
    layer_types: tuple[str, ...]  # 'attention' | 'linear' per layer
    mlp_types: tuple[str, ...]  # 'moe' | 'dense' per layer
    linear: LinearAttnArgs | None = None
    prefix: str = "model"  # module path of the decoder stack ('language_model.model' for Qwen3.5)
    lm_head: str = "lm_head"


def req(tc: dict, key: str, default: Any = None) -> Any:
    """tc[key], or `default`; a missing key without a default is a user-facing error."""
    if key in tc and tc[key] is not None:
        return tc[key]
    if default is None:
        raise PackedModelError(f"config.json lacks {key!r}", hint="the packed model's config.json is incomplete")
    return default


def rope_position_scale(scaling: dict | None) -> float:
    """Positions multiplier for the RoPE variants mlx-lm's initialize_rope maps to plain nn.RoPE."""
    if not scaling:
        return 1.0
    kind = scaling.get("type") or scaling.get("rope_type") or "default"
    if kind in ("default", "mrope"):  # text-only M-RoPE: all three sections carry the same position
        return 1.0
    if kind == "linear":
        return 1.0 / float(scaling["factor"])
    raise MoepackError(f"RoPE scaling type {kind!r} is not supported by the runtime yet",
                       hint="supported: default, linear, mrope (text only)")


def layer_kinds(tc: dict, n_layers: int) -> tuple[str, ...]:
    """'linear' / 'attention' per layer of a hybrid model: config's layer_types, else every
    full_attention_interval-th layer is full attention (mlx-lm's rule)."""
    types = tc.get("layer_types")
    if types:
        if len(types) != n_layers:
            raise PackedModelError(f"config.json layer_types has {len(types)} entries for {n_layers} layers")
        return tuple("linear" if t == "linear_attention" else "attention" for t in types)
    interval = int(tc.get("full_attention_interval", 4))
    return tuple("linear" if (i + 1) % interval else "attention" for i in range(n_layers))


# ------------------------------------------------------------------------------------------------ run context


@dataclass
class LayerTimes:
    attn_s: float = 0.0
    moe_s: float = 0.0
    io_wait_s: float = 0.0
    experts_read: int = 0
    bytes_read: int = 0


@dataclass
class Ctx:
    """What the blocks need while running."""

    K: Any  # kernel module
    reader: Any  # ExpertReader
    top_k: int
    expert_batch: int = 32  # experts per read request in prefill (two requests in flight at most)
    times: dict[int, LayerTimes] = field(default_factory=dict)

    def layer_times(self, layer: int) -> LayerTimes:
        t = self.times.get(layer)
        if t is None:
            t = self.times[layer] = LayerTimes()
        return t


# ------------------------------------------------------------------------------------------------ small pieces


def _no_mark(layer, phase) -> None:
    """Kernel modules without launch-plan phases (kernels_ref, kernels_numba) get this."""


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1) / (np.float32(1) + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def apply_linear(K, x: np.ndarray, lin: QLinear | FloatLinear) -> np.ndarray:
    """x [T, in] -> [T, out]."""
    if isinstance(lin, QLinear):
        return K.qmatmul(x, lin.w, lin.scales, lin.biases, lin.bits, lin.group_size)
    out = np.empty((x.shape[0], lin.out_features), dtype=np.float32)
    step = max(1, (1 << 24) // max(1, lin.in_features))
    for o0 in range(0, lin.out_features, step):
        o1 = min(lin.out_features, o0 + step)
        out[:, o0:o1] = x @ lin.rows_f32(slice(o0, o1)).T
    return out


def embed(K, ids: np.ndarray, table: QLinear | FloatLinear) -> np.ndarray:
    """ids [T] -> [T, D]."""
    if isinstance(table, QLinear):
        return K.qembedding(ids, table.w, table.scales, table.biases, table.bits, table.group_size)
    return table.rows_f32(ids)


def check_out(name: str, lin: QLinear | FloatLinear, out: int) -> None:
    if lin.out_features != out:
        raise ShapeError(f"{name} has {lin.out_features} outputs, config.json implies {out}")


class GLU:
    """down(silu(gate(x)) * up(x)) from three dense linears: dense MLP layers and the shared expert."""

    def __init__(self, gate: QLinear | FloatLinear, up: QLinear | FloatLinear, down: QLinear | FloatLinear):
        self.gate, self.up, self.down = gate, up, down  # [H, D], [H, D], [D, H]
        parts = (gate, up, down)
        # one expert_ffn kernel call when all three are quantized with one group size
        self._fused = all(isinstance(p, QLinear) for p in parts) and len({p.group_size for p in parts}) == 1

    @classmethod
    def load(cls, W: DenseWeights, prefix: str, dim: int, hidden: int) -> "GLU":
        gate = W.linear(f"{prefix}.gate_proj", dim)
        up = W.linear(f"{prefix}.up_proj", dim)
        down = W.linear(f"{prefix}.down_proj", hidden)
        check_out(f"{prefix}.gate_proj", gate, hidden)
        check_out(f"{prefix}.up_proj", up, hidden)
        check_out(f"{prefix}.down_proj", down, dim)
        return cls(gate, up, down)

    def __call__(self, K, x: np.ndarray) -> np.ndarray:
        if self._fused:
            g, u, d = self.gate, self.up, self.down
            return K.expert_ffn(x, g.w, g.scales, g.biases, u.w, u.scales, u.biases, d.w, d.scales, d.biases,
                                (g.bits, u.bits, d.bits), g.group_size)
        h = silu(apply_linear(K, x, self.gate)) * apply_linear(K, x, self.up)
        return apply_linear(K, h, self.down)


class DenseMLP:
    def __init__(self, W: DenseWeights, prefix: str, args: TextArgs):
        self.glu = GLU.load(W, prefix, args.hidden_size, args.intermediate_size)

    def __call__(self, ctx: Ctx, x: np.ndarray, layer: int) -> np.ndarray:
        return self.glu(ctx.K, x)


# ------------------------------------------------------------------------------------------------ attention


class Attention:
    """Full causal attention with per-head q/k RMSNorm and (partial) RoPE; GQA; optional output gate."""

    def __init__(self, W: DenseWeights, prefix: str, args: TextArgs):
        D, Hq, Hkv, hd = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.Hq, self.Hkv, self.hd = Hq, Hkv, hd
        self.gated = args.attention_output_gate
        self.q_proj = W.linear(f"{prefix}.q_proj", D)
        self.k_proj = W.linear(f"{prefix}.k_proj", D)
        self.v_proj = W.linear(f"{prefix}.v_proj", D)
        self.o_proj = W.linear(f"{prefix}.o_proj", Hq * hd)
        check_out(f"{prefix}.q_proj", self.q_proj, Hq * hd * (2 if self.gated else 1))
        check_out(f"{prefix}.k_proj", self.k_proj, Hkv * hd)
        check_out(f"{prefix}.v_proj", self.v_proj, Hkv * hd)
        check_out(f"{prefix}.o_proj", self.o_proj, D)
        self.q_norm = W.vector(f"{prefix}.q_norm.weight")  # [hd]
        self.k_norm = W.vector(f"{prefix}.k_norm.weight")
        self.eps = args.rms_norm_eps
        self.rotary_dim = args.rotary_dim
        self.base = args.rope_theta
        self.pos_scale = args.rope_position_scale
        self.scale = hd**-0.5

    def spec(self) -> LayerSpec:
        return LayerSpec("attention", (self.Hkv, self.hd))

    def __call__(self, K, x: np.ndarray, kv: KVCache, positions: np.ndarray) -> np.ndarray:
        T = x.shape[0]
        Hq, Hkv, hd = self.Hq, self.Hkv, self.hd
        q = apply_linear(K, x, self.q_proj).reshape(T, Hq, -1)  # [T, Hq, hd] or [T, Hq, 2*hd]
        gate = None
        if self.gated:  # per head: hd query dims, then hd gate dims
            q, gate = q[..., :hd], q[..., hd:].reshape(T, Hq * hd)
        k = apply_linear(K, x, self.k_proj).reshape(T, Hkv, hd)
        v = apply_linear(K, x, self.v_proj).reshape(T, Hkv, hd)
        q = K.rmsnorm(np.ascontiguousarray(q).reshape(T * Hq, hd), self.q_norm, self.eps).reshape(T, Hq, hd)
        k = K.rmsnorm(k.reshape(T * Hkv, hd), self.k_norm, self.eps).reshape(T, Hkv, hd)
        rpos = positions if self.pos_scale == 1.0 else positions.astype(np.float32) * np.float32(self.pos_scale)
        q = K.rope(q, rpos, self.rotary_dim, self.base)
        k = K.rope(k, rpos, self.rotary_dim, self.base)
        keys, values = kv.update(k, v)  # [S, Hkv, hd]
        o = K.attention(q, keys, values, positions, self.scale).reshape(T, Hq * hd)
        if gate is not None:
            o = o * sigmoid(gate)
        return apply_linear(K, o, self.o_proj)


# ------------------------------------------------------------------------------------------------ MoE


class MoeBlock:
    """Routed experts streamed from the packed layer file, plus an optional sigmoid-gated shared expert.

    router -> top-k -> submit expert reads -> shared expert while the reads fly -> each needed expert once,
    on all tokens routed to it -> weighted combine. Experts are read in batches of ``ctx.expert_batch``
    alternating between two buffer slots, so a long prompt's compute on one batch overlaps the next's reads
    and the read buffers stay bounded.
    """

    def __init__(self, layer: int, router: QLinear | FloatLinear, bits: tuple[int, int, int], group_size: int,
                 norm_topk_prob: bool, shared: GLU | None = None, shared_gate: QLinear | FloatLinear | None = None):
        self.layer = layer  # which packed layer file the experts come from
        self.router = router  # [E, D]
        self.bits = bits  # routed experts' (gate, up, down) bits
        self.group_size = group_size
        self.norm_topk_prob = norm_topk_prob
        self.shared = shared
        self.shared_gate = shared_gate  # [1, D]

    @classmethod
    def load(cls, W: DenseWeights, prefix: str, layer: int, args: TextArgs, packed, shared: bool) -> "MoeBlock":
        D = args.hidden_size
        router = W.linear(f"{prefix}.gate", D)
        check_out(f"{prefix}.gate", router, args.num_experts)
        glu = gate = None
        if shared:
            glu = GLU.load(W, f"{prefix}.shared_expert", D, args.shared_expert_intermediate_size)
            gate = W.linear(f"{prefix}.shared_expert_gate", D)
            check_out(f"{prefix}.shared_expert_gate", gate, 1)
        layout = packed.layout(layer)
        sizes = {c.group_size for c in layout.components}
        if len(sizes) != 1:
            raise PackedModelError(f"layer {layer}: experts mix group sizes {sorted(sizes)}; the runtime needs one")
        moe = packed.manifest.moe
        if (moe.hidden, moe.moe_intermediate, moe.num_experts) != (D, args.moe_intermediate_size, args.num_experts):
            raise PackedModelError("the manifest's expert shape disagrees with config.json")
        bits = tuple(layout.proj_bits(p) for p in ("gate", "up", "down"))
        return cls(layer, router, bits, sizes.pop(), args.norm_topk_prob, glu, gate)

    def __call__(self, ctx: Ctx, x: np.ndarray, layer: int) -> np.ndarray:
        K = ctx.K
        T, D = x.shape
        times = ctx.layer_times(layer)
        mark = getattr(K, "mark", _no_mark)  # launch-plan phases (GPU backends); a no-op on the CPU
        mark(layer, "routing")
        logits = apply_linear(K, x, self.router)  # [T, E]
        idx, w = K.router_topk(logits, ctx.top_k, self.norm_topk_prob)  # [T, k] int32, [T, k] f32
        experts = np.unique(idx)  # each needed expert once, ascending
        B = max(1, ctx.expert_batch)
        batches = [experts[i : i + B] for i in range(0, len(experts), B)]
        reader = ctx.reader
        wait0 = reader.stats.wait_s
        pending = reader.submit(self.layer, batches[0], slot=0)
        mark(layer, "experts")

        y = np.zeros((T, D), dtype=np.float32)
        if self.shared is not None:  # runs while the expert reads are in flight
            gate = sigmoid(apply_linear(K, x, self.shared_gate))  # [T, 1]
            y += gate * self.shared(K, x)

        gs, bits = self.group_size, self.bits
        # GPU backends take each expert's raw record whole (the kernels read components at their offsets)
        ffn_record = getattr(K, "expert_ffn_record", None)
        layout = reader.packed.layout(self.layer)
        for bi in range(len(batches)):
            current = pending
            if bi + 1 < len(batches):  # the other slot's request (batch bi-1) is fully consumed by now
                pending = reader.submit(self.layer, batches[bi + 1], slot=(bi + 1) % 2)
            raw = current.records() if ffn_record is not None else None
            block = current.record_block() if raw is not None and T == 1 else None
            if block is not None and hasattr(K, "moe_combine"):
                # GPU decode: every expert of the batch in two launches straight from the record rows, then one
                # launch adds them to the shared expert's part: y + sum_k w_k * y_k
                ys = K.moe_experts(x, block, layout)  # [n, 1, D]
                wk = np.array([[w[0, int(np.flatnonzero(idx[0] == e)[0])] for e in batches[bi]]], np.float32)
                y = K.moe_combine(y, ys.reshape(1, len(batches[bi]), D), wk)  # [1, D]
                continue
            # each expert as soon as its record is in (compute overlaps the reads still running); the results
            # are added in expert order, so the sum does not depend on which read finished first
            outs = {}
            for e, a in (current.wait().items() if raw is not None else current.completed()):
                rows, slots = np.nonzero(idx == e)  # tokens routed to e (each at most once)
                if raw is not None:
                    out = ffn_record(x[rows], raw[int(e)], layout)  # [n, D]
                else:
                    out = K.expert_ffn(x[rows], a["gate.weight"], a["gate.scales"], a["gate.biases"],
                                       a["up.weight"], a["up.scales"], a["up.biases"],
                                       a["down.weight"], a["down.scales"], a["down.biases"], bits, gs)  # [n, D]
                outs[int(e)] = (rows, w[rows, slots][:, None] * out)
            for e in batches[bi]:
                rows, contribution = outs[int(e)]
                y[rows] += contribution
        times.io_wait_s += reader.stats.wait_s - wait0
        times.experts_read += len(experts)
        times.bytes_read += len(experts) * reader.packed.layout(self.layer).record_size
        return y


# ------------------------------------------------------------------------------------------------ decoder


@dataclass
class DecoderLayer:
    mixer: Any  # Attention | GatedDeltaNet: (K, x, state, positions) -> [T, D]
    mlp: Any  # MoeBlock | DenseMLP: (ctx, x, layer) -> [T, D]
    input_norm: np.ndarray  # [D]
    post_norm: np.ndarray  # [D]


class DecoderModel:
    """embed -> layers (x + mixer(norm(x)); h + mlp(norm(h))) -> norm -> lm_head."""

    def __init__(self, W: DenseWeights, args: TextArgs, layers: list[DecoderLayer]):
        self.args = args
        D = args.hidden_size
        self.embed_tokens = W.linear(f"{args.prefix}.embed_tokens", D)
        self.norm = W.vector(f"{args.prefix}.norm.weight")
        if args.tie_word_embeddings or not W.has(f"{args.lm_head}.weight"):
            if not args.tie_word_embeddings:
                raise PackedModelError(f"the packed model has no {args.lm_head}.weight and does not tie embeddings")
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = W.linear(args.lm_head, D)
        self.layers = layers

    def layer_specs(self) -> list[LayerSpec]:
        return [layer.mixer.spec() for layer in self.layers]

    def forward(self, ctx: Ctx, ids: np.ndarray, cache: Cache) -> np.ndarray:
        """ids [T] -> logits [T, V]; positions continue from cache.offset; the cache is updated in place."""
        K, eps = ctx.K, self.args.rms_norm_eps
        T = ids.shape[0]
        positions = np.arange(cache.offset, cache.offset + T, dtype=np.int64)  # [T]
        mark = getattr(K, "mark", _no_mark)
        mark(None, "embed")
        h = embed(K, ids, self.embed_tokens)  # [T, D]
        for i, layer in enumerate(self.layers):
            times = ctx.layer_times(i)
            t0 = time.perf_counter()
            mark(i, "attention")
            h = h + layer.mixer(K, K.rmsnorm(h, layer.input_norm, eps), cache.layers[i], positions)
            t1 = time.perf_counter()
            mark(i, "routing" if isinstance(layer.mlp, MoeBlock) else "mlp")
            h = h + layer.mlp(ctx, K.rmsnorm(h, layer.post_norm, eps), i)
            times.attn_s += t1 - t0
            times.moe_s += time.perf_counter() - t1
        cache.offset += T
        mark(None, "head")
        return apply_linear(K, K.rmsnorm(h, self.norm, eps), self.lm_head)  # [T, V]


def build_decoder(W: DenseWeights, packed, args: TextArgs, make_linear_mixer=None, shared_expert: bool = False):
    """The decoder stack of `args`; `make_linear_mixer(W, prefix, args)` builds linear-attention layers."""
    expert_layers = {e.layer for e in packed.manifest.layers}
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"{args.prefix}.layers.{i}"
        if args.layer_types[i] == "linear":
            if make_linear_mixer is None:
                raise PackedModelError(f"layer {i} is a linear-attention layer, which this architecture lacks")
            mixer = make_linear_mixer(W, f"{p}.linear_attn", args)
        else:
            mixer = Attention(W, f"{p}.self_attn", args)
        if args.mlp_types[i] == "moe":
            if i not in expert_layers:
                raise PackedModelError(f"layer {i} is an MoE layer but the packed model has no experts for it")
            mlp = MoeBlock.load(W, f"{p}.mlp", i, args, packed, shared_expert)
        else:
            mlp = DenseMLP(W, f"{p}.mlp", args)
        layers.append(DecoderLayer(mixer, mlp, W.vector(f"{p}.input_layernorm.weight"),
                                   W.vector(f"{p}.post_attention_layernorm.weight")))
    return DecoderModel(W, args, layers)
