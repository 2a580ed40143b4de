"""A device-resident decode step on the Metal kernels: one token through the whole model with the
activations, the KV cache and the Gated-DeltaNet states in persistent device buffers (DeviceBuffer).

The prefill keeps the kernel-module path (``GpuKernels`` under the model code); at the first decode step on
a cache its state is uploaded once (``attach``), and from then on a step is:

    [embed, layer 0 attention + routing]                   -> read back layer 0's top-k ids + weights
    [layer 0 shared expert]             (while the expert reads fly)
    [layer 0 routed experts + combine, layer 1 attention + routing]   -> read back layer 1's top-k ...
    ...
    [last layer's experts + combine, final norm, lm_head]  -> read back the logits

so a step of an all-MoE model is ``layers + 1`` command buffers that end in a read-back (plus one per layer
with a shared expert), and the host reads back only what it must: the router's choice (it issues the expert
reads, ``ExpertReader``; their record rows go to the expert kernels as they are) and the logits. Dense-MLP
layers run inside the command buffer of their attention. Everything in between (residual adds, the sigmoid
output gates, the Gated-DeltaNet gates and q/k L2 norms, regrouping Qwen3-Next's fused projections) runs in
``metal/glue.metal``; the KV row of the new position is written in place by the norm / RoPE / v-projection
kernels.

The host cache is stale while the device holds the state: ``sync(cache)`` downloads the new KV rows and the
linear-attention states back (``Model.sync_cache``; ``Cache.state_dict()`` calls it itself through
``cache.device_sync``, so sessions and truncation see the newest state; a prefill on the cache syncs first).
"""

from __future__ import annotations

import time

import numpy as np

from ...errors import MoepackError
from ..cache import Cache, KVCache, LinearState
from ..weights import FloatLinear, QLinear
from . import ops_glue as G
from . import ops_quant, ops_seq
from .backend import Launch
from .dispatch import DeviceBuffer, Dispatch, has_buffers

KV_STEP = 256  # KV capacity granularity (positions), as the host KVCache


class ResidentUnsupported(MoepackError):
    """The model (or executor) has a part the resident step does not cover; the caller keeps the old path."""


def _check_linear(lin, name: str) -> None:
    if isinstance(lin, QLinear):
        if lin.bits not in ops_quant.KERNEL_BITS:
            raise ResidentUnsupported(f"{name} is {lin.bits}-bit (kernels: {ops_quant.KERNEL_BITS})")
    elif isinstance(lin, FloatLinear):
        if lin.dtype not in G.FLOAT_SUFFIX:
            raise ResidentUnsupported(f"{name} holds {lin.dtype} weights")
    else:
        raise ResidentUnsupported(f"{name} is a {type(lin).__name__}")


class _Counters:
    def __init__(self):
        self.command_buffers = 0
        self.readbacks = 0
        self.uploads = 0
        self.launches = 0
        self.steps = 0

    def to_json(self) -> dict:
        return dict(vars(self))


class ResidentDecoder:
    """Decode steps of a loaded ``Model`` (GPU backend) with the state on the device."""

    def __init__(self, model):
        from ..models.common import Attention, DenseMLP, MoeBlock
        from ..models.qwen3_next import GatedDeltaNet

        gk = model.K
        ex = getattr(gk, "executor", None)
        if ex is None or not has_buffers(ex):
            raise ResidentUnsupported(f"the {getattr(gk, 'name', '?')} backend keeps no device buffers")
        self.model, self.gk, self.ex = model, gk, ex
        self.dec = model.decoder
        self.args = a = model.args
        self.reader = model.reader
        self.k = model.experts_per_token
        self.counters = _Counters()
        self.last_step: dict = {}
        self.trace: list[dict] | None = None  # set to [] to record each command buffer (launch plan)
        self.describe = False  # log each launch's buffers too (as GpuKernels does); off: kernel and geometry
        self.D = D = a.hidden_size
        self.V = self.dec.lm_head.out_features
        self._Attention, self._GDN, self._Moe, self._Dense = Attention, GatedDeltaNet, MoeBlock, DenseMLP
        self._check()
        # ---------------------------------------------------------------- persistent buffers (activations)
        f32 = np.float32
        self.h = ex.alloc((D,), f32)  # the residual stream
        self.xn = ex.alloc((D,), f32)  # normed input of the mixer / MLP / head
        self.tmp = ex.alloc((D,), f32)  # mixer / MLP output before the residual add
        self.ids = ex.alloc((1,), np.int32)
        self.pos_f = ex.alloc((1,), f32)
        self.pos_i = ex.alloc((1,), np.int32)
        self.logits = ex.alloc((self.V,), f32)
        self._consts: dict[int, DeviceBuffer] = {}
        att = [m for m in (l.mixer for l in self.dec.layers) if isinstance(m, Attention)]
        lin = [m for m in (l.mixer for l in self.dec.layers) if isinstance(m, GatedDeltaNet)]
        moes = [l.mlp for l in self.dec.layers if isinstance(l.mlp, MoeBlock)]
        if att:
            m0 = att[0]
            qw = max(m.q_proj.out_features for m in att)
            self.q = ex.alloc((qw,), f32)
            self.qn = ex.alloc((m0.Hq * m0.hd,), f32)
            self.kx = ex.alloc((m0.Hkv * m0.hd,), f32)
            self.o = ex.alloc((m0.Hq * m0.hd,), f32)
            n = ops_seq.ATT_MAX_SPLIT
            self.att_scratch = (ex.alloc((m0.Hq * n,), f32), ex.alloc((m0.Hq * n,), f32),
                                ex.alloc((m0.Hq * n * m0.hd,), f32))
            self.inv_freq = {}
        if lin:
            m0 = lin[0]
            C, vd, nv = m0.conv_dim, m0.value_dim, m0.nv
            self.proj = ex.alloc((C + vd,), f32)  # conv input (q | k | v) then z
            self.ba = ex.alloc((2 * nv,), f32)  # b then a
            self.conv_out = ex.alloc((C,), f32)
            self.beta = ex.alloc((nv,), f32)
            self.gate_g = ex.alloc((nv,), f32)
            self.dout = ex.alloc((vd,), f32)
            self.gn = ex.alloc((vd,), f32)
            if m0.fused:
                self.raw_qkvz = ex.alloc((m0.in_proj_qkvz.out_features,), f32)
                self.raw_ba = ex.alloc((m0.in_proj_ba.out_features,), f32)
                qkvz_idx, ba_idx = self._fused_index(m0)
                self.qkvz_idx = self._upload_new(qkvz_idx)
                self.ba_idx = self._upload_new(ba_idx)
        hidden = [l.mlp.glu for l in self.dec.layers if isinstance(l.mlp, DenseMLP)]
        hidden += [m.shared for m in moes if m.shared is not None]
        if hidden:
            H = max(g.gate.out_features for g in hidden)
            self.hid = ex.alloc((H,), f32)
            self.hid2 = ex.alloc((H,), f32)
        if moes:
            self.shared_out = ex.alloc((D,), f32)
            self.shared_logit = ex.alloc((1,), f32)
            self.router_logits = ex.alloc((max(m.router.out_features for m in moes),), f32)
            self.topk = ex.alloc((2 * self.k,), np.uint32)  # int32 ids then float32 weights: one read-back
            I = max(self.reader.packed.layout(m.layer).component("gate.weight").shape[0] for m in moes)
            self.eh = ex.alloc((self.k * I,), f32)
            self.ey = ex.alloc((self.k * D,), f32)
            self.wk = ex.alloc((self.k,), f32)
        # ---------------------------------------------------------------- device state of one cache
        self._cache: Cache | None = None
        self._state: list = []
        self._host_len: list[int] = []
        self._offset = -1
        self.dirty = False

    # ------------------------------------------------------------------------------------------ checks
    def _check(self) -> None:
        a = self.args
        for name in ("embed_tokens", "lm_head"):
            _check_linear(getattr(self.dec, name), name)
        for i, layer in enumerate(self.dec.layers):
            m = layer.mixer
            if isinstance(m, self._Attention):
                for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    _check_linear(getattr(m, p), f"layer {i} {p}")
                if m.hd > ops_seq.ATT_MAX_HD or m.rotary_dim // 2 > ops_seq.ROPE_MAX_HALF:
                    raise ResidentUnsupported(f"layer {i}: head dim {m.hd} / rotary dim {m.rotary_dim} too large")
            elif isinstance(m, self._GDN):
                parts = ("in_proj_qkvz", "in_proj_ba") if m.fused else ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                         "in_proj_a")
                for p in parts + ("out_proj",):
                    _check_linear(getattr(m, p), f"layer {i} {p}")
                if m.dk > ops_seq.DELTA_MAX_DK or not 1 <= m.Kc <= ops_seq.CONV_MAX_K:
                    raise ResidentUnsupported(f"layer {i}: key head dim {m.dk} / conv width {m.Kc} beyond the kernels")
            else:
                raise ResidentUnsupported(f"layer {i}: mixer {type(m).__name__}")
            mlp = layer.mlp
            glus = []
            if isinstance(mlp, self._Moe):
                _check_linear(mlp.router, f"layer {i} router")
                if mlp.router.out_features > ops_seq.ROUTER_MAX_E or self.k > ops_seq.ROUTER_MAX_K:
                    raise ResidentUnsupported(f"layer {i}: {mlp.router.out_features} experts / top {self.k}")
                bad = sorted({b for b in mlp.bits if b not in ops_quant.KERNEL_BITS})
                if bad:
                    raise ResidentUnsupported(f"layer {i}: {bad[0]}-bit experts (kernels: {ops_quant.KERNEL_BITS})")
                if mlp.shared is not None:
                    glus.append(mlp.shared)
                    _check_linear(mlp.shared_gate, f"layer {i} shared_expert_gate")
            elif isinstance(mlp, self._Dense):
                glus.append(mlp.glu)
            else:
                raise ResidentUnsupported(f"layer {i}: MLP {type(mlp).__name__}")
            for g in glus:
                for p in ("gate", "up", "down"):
                    _check_linear(getattr(g, p), f"layer {i} {p}")
        if a.hidden_size > G.NORM_PER * 1024:
            raise ResidentUnsupported("hidden size beyond the norm kernels")

    @staticmethod
    def _fused_index(m) -> tuple[np.ndarray, np.ndarray]:
        """Gather indices turning Qwen3-Next's per-key-head in_proj_qkvz / in_proj_ba outputs into [q | k | v | z]
        and [b | a] (the slicing of GatedDeltaNet._project applied to index arrays)."""
        nk, nv, dk, dv = m.nk, m.nv, m.dk, m.dv
        r = nv // nk
        qkvz = np.arange(m.in_proj_qkvz.out_features).reshape(nk, 2 * dk + 2 * r * dv)
        ba = np.arange(m.in_proj_ba.out_features).reshape(nk, 2 * r)
        order = [qkvz[:, :dk], qkvz[:, dk:2 * dk], qkvz[:, 2 * dk:2 * dk + r * dv], qkvz[:, 2 * dk + r * dv:]]
        return (np.concatenate([o.reshape(-1) for o in order]).astype(np.int32),
                np.concatenate([ba[:, :r].reshape(-1), ba[:, r:].reshape(-1)]).astype(np.int32))

    # ------------------------------------------------------------------------------------------ plumbing
    def _upload_new(self, arr: np.ndarray) -> DeviceBuffer:
        arr = np.ascontiguousarray(arr)
        buf = self.ex.alloc(arr.shape, arr.dtype)
        self._upload(buf, arr)
        return buf

    def _upload(self, buf: DeviceBuffer, arr) -> None:
        self.ex.upload(buf, arr)
        self.counters.uploads += 1

    def _download(self, buf: DeviceBuffer, what: str = "") -> np.ndarray:
        self.counters.readbacks += 1
        if self.trace:
            self.trace[-1]["read_back"].append(f"{what} {buf.dtype}[{', '.join(map(str, buf.shape))}]".strip())
        return self.ex.download(buf)

    def const(self, arr: np.ndarray) -> DeviceBuffer:
        """A small float vector of the model (norm weights, conv weights, A, dt_bias) on the device, once."""
        buf = self._consts.get(id(arr))
        if buf is None:
            buf = self._consts[id(arr)] = self._upload_new(arr)
        return buf

    def _run(self, cb: list[tuple[Dispatch, int | None, str]]) -> None:
        if not cb:
            return
        log = self.gk.log
        if self.trace is not None or self.describe:
            for d, layer, phase in cb:
                log.add(d, layer, phase)
        else:  # kernel and geometry only: describing every buffer costs more than a small GPU step
            log.count += len(cb)
            for d, layer, phase in cb[: max(0, log.keep - len(log.launches))]:
                log.launches.append(Launch(layer, phase, d.source, d.kernel, d.grid, d.threadgroup, {}))
        t0 = time.perf_counter()
        self.ex.run([d for d, _, _ in cb])
        self.gk.log.gpu_s += time.perf_counter() - t0
        if self.trace is not None:
            self.trace.append({"launches": [x.to_json() for x in self.gk.log.launches[-len(cb):]], "read_back": []})
        self.counters.command_buffers += 1
        self.counters.launches += len(cb)
        cb.clear()

    def _linear(self, lin, x, y, y_off: int = 0) -> list[Dispatch]:
        if isinstance(lin, QLinear):
            return G.dev_qmv(x, lin.w, lin.scales, lin.biases, y, lin.bits, lin.group_size, lin.in_features,
                             lin.out_features, y_off=y_off)
        return G.matvec_dispatch(x, lin.weight, y, lin.dtype, lin.in_features, lin.out_features, y_off=y_off)

    def _glu(self, glu, x, out) -> list[Dispatch]:
        H = glu.gate.out_features
        hid = self.hid.view(0, (H,))
        if glu._fused:
            ds = G.dev_gate_up(x, glu.gate, glu.up, hid, glu.gate.in_features, H)
        else:
            hid2 = self.hid2.view(0, (H,))
            ds = self._linear(glu.gate, x, hid) + self._linear(glu.up, x, hid2) + G.swiglu_dispatch(hid, hid2, hid, H)
        return ds + self._linear(glu.down, hid, out)

    # ------------------------------------------------------------------------------------------ cache state
    def attach(self, cache: Cache) -> None:
        """Upload `cache` (host, after a prefill) to the device; the device state then belongs to it."""
        if self._cache is not None and self._cache is not cache:
            self.sync(self._cache)
        state, host_len = [], []
        for i, (layer, st) in enumerate(zip(self.dec.layers, cache.layers)):
            if isinstance(st, KVCache):
                n = st.length
                cap = -(-(n + KV_STEP) // KV_STEP) * KV_STEP
                k = self.ex.alloc((cap, st.n_kv_heads, st.head_dim), np.float32)
                v = self.ex.alloc((cap, st.n_kv_heads, st.head_dim), np.float32)
                if n:
                    self._upload(k.view(0, (n, st.n_kv_heads, st.head_dim)), st.keys)
                    self._upload(v.view(0, (n, st.n_kv_heads, st.head_dim)), st.values)
                state.append([k, v])
                host_len.append(n)
            elif isinstance(st, LinearState):
                conv = self._upload_new(st.conv if st.conv.size else np.zeros((1, st.conv.shape[1]), np.float32))
                state.append([conv, self._upload_new(st.recurrent)])
                host_len.append(0)
            else:
                state.append(None)
                host_len.append(0)
        self._cache, self._state, self._host_len = cache, state, host_len
        self._offset = cache.offset
        self.dirty = False
        cache.device_sync = lambda: self.sync(cache)  # state_dict() (sessions) sees the device's newest state

    def holds(self, cache: Cache) -> bool:
        return self._cache is cache and self._offset == cache.offset

    def sync(self, cache: Cache, release: bool = False) -> None:
        """Bring the host `cache` up to date with the device (new KV rows, linear-attention states) if the
        device holds it; `release`: forget the device state afterwards (the host will change the cache)."""
        if self._cache is cache and self.dirty:
            for i, (st, dev) in enumerate(zip(cache.layers, self._state)):
                if isinstance(st, KVCache):
                    n0, n1 = st.length, self._offset
                    if n1 > n0:
                        shape = (n1 - n0, st.n_kv_heads, st.head_dim)
                        row = st.n_kv_heads * st.head_dim
                        st.update(self._download(dev[0].view(n0 * row, shape)),
                                  self._download(dev[1].view(n0 * row, shape)))
                elif isinstance(st, LinearState):
                    if st.conv.size:
                        st.conv[...] = self._download(dev[0])
                    st.recurrent[...] = self._download(dev[1])
            self.dirty = False
        if release and self._cache is cache:
            self._cache, self._state, self._offset = None, [], -1
            cache.device_sync = None

    def _grow(self, i: int, pos: int, cb: list) -> None:
        """Room for position `pos` in layer i's device KV cache (a bigger buffer, old rows copied on the device)."""
        k, v = self._state[i]
        cap = k.shape[0]
        if pos < cap:
            return
        new_cap = -(-max(pos + 1, cap + cap // 4) // KV_STEP) * KV_STEP
        grown = []
        for old in (k, v):
            new = self.ex.alloc((new_cap,) + old.shape[1:], np.float32)
            for d in G.copy_dispatch(old, new.view(0, (old.size,)), old.size):
                cb.append((d, i, "attention"))
            grown.append(new)
        self._state[i] = grown

    # ------------------------------------------------------------------------------------------ one step
    def step(self, token: int, cache: Cache) -> np.ndarray:
        """One decode token -> logits f32 [1, vocab]; cache.offset advances (its arrays on the host do not)."""
        if not self.holds(cache):
            self.attach(cache)
        c0 = self.counters.to_json()
        pos = cache.offset
        a = self.args
        self._upload(self.ids, np.array([token], np.int32))
        self._upload(self.pos_i, np.array([pos], np.int32))
        pscale = a.rope_position_scale
        self._upload(self.pos_f, np.array([pos], np.float32) * np.float32(pscale) if pscale != 1.0
                     else np.array([pos], np.float32))
        times = self.model._ctx.layer_times
        cb: list = []
        emb = self.dec.embed_tokens
        ds = (G.dev_qembed(self.ids, emb, self.h, self.D) if isinstance(emb, QLinear)
              else G.embed_rows_dispatch(self.ids, emb.weight, self.h, emb.dtype, self.D))
        cb += [(d, None, "embed") for d in ds]
        pending = None  # (layer, MoeBlock, experts, weights, Pending) whose experts are still to run
        eps = a.rms_norm_eps
        for i, layer in enumerate(self.dec.layers):
            t0 = time.perf_counter()
            if pending is not None:
                self._experts(pending, cb)
                pending = None
            ds = G.dev_rmsnorm(self.h, self.const(layer.input_norm), self.xn, 1, self.D, eps)
            if isinstance(layer.mixer, self._Attention):
                ds += self._attention(i, layer.mixer, pos, cb)
            else:
                ds += self._linear_attention(i, layer.mixer)
            ds += G.add_dispatch(self.h, self.tmp, self.h, self.D)
            ds += G.dev_rmsnorm(self.h, self.const(layer.post_norm), self.xn, 1, self.D, eps)
            cb += [(d, i, "attention") for d in ds]
            mlp = layer.mlp
            lt = times(i)
            if isinstance(mlp, self._Dense):
                ds = self._glu(mlp.glu, self.xn, self.tmp) + G.add_dispatch(self.h, self.tmp, self.h, self.D)
                cb += [(d, i, "mlp") for d in ds]
                lt.attn_s += time.perf_counter() - t0
                continue
            # routing: router + top-k, then the one read-back of the layer
            E = mlp.router.out_features
            rl = self.router_logits.view(0, (E,))
            idx_b = self.topk.view(0, (self.k,), np.int32)
            w_b = self.topk.view(self.k, (self.k,), np.float32)
            ds = self._linear(mlp.router, self.xn, rl) + G.dev_router(rl, idx_b, w_b, E, self.k, mlp.norm_topk_prob)
            cb += [(d, i, "routing") for d in ds]
            self._run(cb)
            t1 = time.perf_counter()
            lt.attn_s += t1 - t0
            got = self._download(self.topk, "top-k ids + weights")
            idx, w = got[: self.k].view(np.int32), got[self.k:].view(np.float32)
            experts = np.unique(idx)
            wk = np.array([w[int(np.flatnonzero(idx == e)[0])] for e in experts], np.float32)
            wait0 = self.reader.stats.wait_s
            req = self.reader.submit(mlp.layer, experts, slot=0)
            if mlp.shared is not None:  # runs while the expert reads are in flight
                ds = self._glu(mlp.shared, self.xn, self.shared_out)
                ds += self._linear(mlp.shared_gate, self.xn, self.shared_logit)
                cb += [(d, i, "experts") for d in ds]
                self._run(cb)
            pending = (i, mlp, experts, wk, req, wait0)
            lt.moe_s += time.perf_counter() - t1
        if pending is not None:
            self._experts(pending, cb)
        ds = G.dev_rmsnorm(self.h, self.const(self.dec.norm), self.xn, 1, self.D, eps)
        ds += self._linear(self.dec.lm_head, self.xn, self.logits)
        cb += [(d, None, "head") for d in ds]
        self._run(cb)
        logits = self._download(self.logits, "logits").reshape(1, self.V)
        cache.offset += 1
        self._offset = cache.offset
        self.dirty = True
        self.counters.steps += 1
        c1 = self.counters.to_json()
        self.last_step = {k: c1[k] - c0[k] for k in c1}
        return logits

    def _experts(self, pending, cb: list) -> None:
        """Wait for layer i's expert records; add its routed experts (and shared expert) onto h."""
        i, mlp, experts, wk, req, wait0 = pending
        t0 = time.perf_counter()
        block = req.record_block()
        if block is None:  # some records were used in place (mapped io): gather them into one block
            recs = req.records()
            block = np.stack([recs[int(e)] for e in experts])
        layout = self.reader.packed.layout(mlp.layer)
        n = len(experts)
        self._upload(self.wk.view(0, (n,)), wk)
        I = layout.component("gate.weight").shape[0]
        ey = self.ey.view(0, (n, self.D))
        ds = G.dev_experts(self.xn, block, layout, self.eh.view(0, (n, I)), ey)
        if mlp.shared is not None:
            ds += G.dev_combine(self.h, ey, self.wk.view(0, (1, n)), self.h, self.D, n, self.shared_out,
                                self.shared_logit)
        else:
            ds += G.dev_combine(self.h, ey, self.wk.view(0, (1, n)), self.h, self.D, n)
        cb += [(d, i, "experts") for d in ds]
        lt = self.model._ctx.layer_times(i)
        lt.io_wait_s += self.reader.stats.wait_s - wait0
        lt.experts_read += n
        lt.bytes_read += n * layout.record_size
        lt.moe_s += time.perf_counter() - t0

    def _attention(self, i: int, m, pos: int, cb: list) -> list[Dispatch]:
        Hq, Hkv, hd = m.Hq, m.Hkv, m.hd
        self._grow(i, pos, cb)
        kc, vc = self._state[i]
        row = Hkv * hd
        W = m.q_proj.out_features // Hq  # hd, or 2 * hd with the output gate
        q = self.q.view(0, (Hq * W,))
        qn = self.qn.view(0, (1, Hq, hd))
        krow = kc.view(pos * row, (1, Hkv, hd))
        key = (m.rotary_dim, m.base)
        inv = self.inv_freq.get(key)
        if inv is None:
            f = ops_seq.rope_inv_freq(m.rotary_dim, m.base) if m.rotary_dim // 2 else np.zeros(1, np.float32)
            inv = self.inv_freq[key] = self._upload_new(f)
        ds = self._linear(m.q_proj, self.xn, q)
        ds += self._linear(m.k_proj, self.xn, self.kx)
        ds += self._linear(m.v_proj, self.xn, vc.view(0, (vc.size,)), y_off=pos * row)
        ds += G.dev_rmsnorm(q, self.const(m.q_norm), qn, Hq, hd, m.eps, x_stride=W, y_stride=hd)
        ds += G.dev_rmsnorm(self.kx, self.const(m.k_norm), krow, Hkv, hd, m.eps)
        ds += G.dev_rope(qn, self.pos_f, inv, qn, Hq, hd, m.rotary_dim)
        ds += G.dev_rope(krow, self.pos_f, inv, krow, Hkv, hd, m.rotary_dim)
        o = self.o.view(0, (1, Hq, hd))
        ds += G.dev_attention(qn, kc, vc, self.pos_i, o, Hq, Hkv, hd, pos + 1, m.scale, self.att_scratch)
        if m.gated:
            ds += G.sigmoid_gate_dispatch(o, q, o, Hq, hd, W, hd)
        return ds + self._linear(m.o_proj, o, self.tmp)

    def _linear_attention(self, i: int, m) -> list[Dispatch]:
        nk, nv, dk, dv, kd = m.nk, m.nv, m.dk, m.dv, m.key_dim
        C, vd = m.conv_dim, m.value_dim
        conv_state, rec = self._state[i]
        qkv, z = self.proj.view(0, (C,)), self.proj.view(C, (vd,))
        b, av = self.ba.view(0, (nv,)), self.ba.view(nv, (nv,))
        if m.fused:
            F1, F2 = m.in_proj_qkvz.out_features, m.in_proj_ba.out_features
            ds = self._linear(m.in_proj_qkvz, self.xn, self.raw_qkvz) + self._linear(m.in_proj_ba, self.xn, self.raw_ba)
            ds += G.gather_dispatch(self.raw_qkvz, self.qkvz_idx, self.proj, F1)
            ds += G.gather_dispatch(self.raw_ba, self.ba_idx, self.ba, F2)
        else:
            ds = self._linear(m.in_proj_qkv, self.xn, self.proj) + self._linear(m.in_proj_z, self.xn, self.proj, C)
            ds += self._linear(m.in_proj_b, self.xn, self.ba) + self._linear(m.in_proj_a, self.xn, self.ba, nv)
        co = self.conv_out
        ds += G.dev_conv1d(qkv, conv_state, self.const(m.conv_w), co, C, m.Kc)
        qk = co.view(0, (2 * nk, dk))
        ds += G.l2norm_scale_dispatch(qk, qk, 2 * nk, dk, nk, dk ** -0.5, 1.0, 1e-6)
        ds += G.gdn_gates_dispatch(b, av, self.const(m.A), self.const(m.dt_bias), self.beta, self.gate_g, nv)
        ds += G.dev_gated_delta(co.view(0, (1, nk, dk)), co.view(kd, (1, nk, dk)), co.view(2 * kd, (1, nv, dv)),
                                self.gate_g, self.beta, rec, self.dout, nk, nv, dk, dv)
        ds += G.dev_gated_rmsnorm(self.dout, z, self.const(m.norm), self.gn, nv, dv, m.eps)
        return ds + self._linear(m.out_proj, self.gn, self.tmp)


def make_resident(model) -> ResidentDecoder | None:
    """The model's resident decoder, or None (with model.resident_error set) when it cannot have one."""
    try:
        return ResidentDecoder(model)
    except ResidentUnsupported as e:
        model.resident_error = e.message
        return None
