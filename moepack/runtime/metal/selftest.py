"""`moepack selftest`: compile every Metal kernel on this machine's executor and check it against numpy.

On a Mac this is how a first user reports that Apple's compiler accepts ``metal/*.metal`` and that the
kernels compute what the numpy reference (``moepack.runtime.kernels_ref``) computes; on Linux it runs the
same checks through the CPU emulator, on an NVIDIA machine through PTX. Inputs are small and seeded, so two
machines run the very same cases.

Each case: the op, its shapes, the largest error relative to the reference's largest magnitude, the
tolerance, pass/fail and the time it took (compile included on first use of a file).
"""

from __future__ import annotations

import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import numpy as np

from ... import __version__
from .. import kernels_ref as R
from ...quant.affine_ref import quantize
from . import ops_quant, ops_seq
from .dispatch import Executor

TOL = 2e-4  # fp32 with fast-math exp/rsqrt: the design's 1e-4, doubled for quantized dot products


@dataclass
class CaseResult:
    op: str
    shapes: str
    ok: bool
    max_rel_err: float | None
    tolerance: float
    seconds: float
    error: str = ""


def _q(rng, out_dim, in_dim, bits, gs=64):
    w = rng.standard_normal((out_dim, in_dim)).astype(np.float32) * 0.1
    return quantize(w, bits, gs)  # (packed uint32, scales bf16, biases bf16)


def _rel(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape {a.shape} differs from the reference's {b.shape}")
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def cases(seed: int = 0):
    """(op, shapes, run(executor) -> list of (result, reference) pairs | ('exact', a, b))."""
    rng = np.random.default_rng(seed)
    out = []
    for bits in ops_quant.KERNEL_BITS:
        x = rng.standard_normal((2, 256)).astype(np.float32)
        w, s, b = _q(rng, 64, 256, bits)
        out.append((f"qmatmul {bits}-bit", "x[2,256] W[64,256] gs64",
                    lambda ex, x=x, w=w, s=s, b=b, bits=bits: [
                        (ops_quant.qmatmul(ex, x, w, s, b, bits, 64), R.qmatmul(x, w, s, b, bits, 64))]))
    x = rng.standard_normal((2, 128)).astype(np.float32)
    g, u, d = _q(rng, 64, 128, 4), _q(rng, 64, 128, 4), _q(rng, 128, 64, 2)
    out.append(("expert_ffn 4/4/2-bit", "x[2,128] I=64",
                lambda ex: [(ops_quant.expert_ffn(ex, x, *g, *u, *d, (4, 4, 2), 64),
                             R.expert_ffn(x, *g, *u, *d, (4, 4, 2), 64))]))
    e = _q(rng, 50, 128, 4)
    ids = np.array([3, 49, 0], dtype=np.int64)
    out.append(("qembedding 4-bit", "V=50 D=128 ids[3]",
                lambda ex: [(ops_quant.qembedding(ex, ids, *e, 4, 64), R.qembedding(ids, *e, 4, 64))]))
    res = rng.standard_normal((2, 96)).astype(np.float32)
    ys = rng.standard_normal((2, 4, 96)).astype(np.float32)
    wk = rng.random((2, 4)).astype(np.float32)
    sh = rng.standard_normal((2, 96)).astype(np.float32)
    sl = np.array([0.3, -1.2], dtype=np.float32)
    out.append(("moe_combine", "T=2 D=96 K=4 + shared",
                lambda ex: [(ops_quant.moe_combine(ex, res, ys, wk, sh, sl),
                             ops_quant.moe_combine_ref(res, ys, wk, sh, sl))]))
    xn = rng.standard_normal((3, 128)).astype(np.float32)
    wn = (1 + 0.1 * rng.standard_normal(128)).astype(np.float32)
    out.append(("rmsnorm", "x[3,128]", lambda ex: [(ops_seq.rmsnorm(ex, xn, wn, 1e-6), R.rmsnorm(xn, wn, 1e-6))]))
    xg = rng.standard_normal((2, 4, 32)).astype(np.float32)
    zg = rng.standard_normal((2, 4, 32)).astype(np.float32)
    wg = (1 + 0.1 * rng.standard_normal(32)).astype(np.float32)
    out.append(("gated_rmsnorm", "x[2,4,32]",
                lambda ex: [(ops_seq.gated_rmsnorm(ex, xg, zg, wg, 1e-6), R.gated_rmsnorm(xg, zg, wg, 1e-6))]))
    xr = rng.standard_normal((2, 4, 64)).astype(np.float32)
    pr = np.array([5, 6], dtype=np.int64)
    out.append(("rope", "x[2,4,64] rotary 16",
                lambda ex: [(ops_seq.rope(ex, xr, pr, 16, 10000.0), R.rope(xr, pr, 16, 10000.0))]))
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    k = rng.standard_normal((8, 2, 32)).astype(np.float32)
    v = rng.standard_normal((8, 2, 32)).astype(np.float32)
    qp = np.array([6, 7], dtype=np.int64)
    out.append(("attention", "q[2,4,32] kv[8,2,32]",
                lambda ex: [(ops_seq.attention(ex, q, k, v, qp, 32 ** -0.5), R.attention(q, k, v, qp, 32 ** -0.5))]))
    xc = rng.standard_normal((2, 48)).astype(np.float32)
    sc = rng.standard_normal((3, 48)).astype(np.float32)
    wc = rng.standard_normal((48, 4)).astype(np.float32)

    def conv(ex):
        y, st = ops_seq.conv1d_step(ex, xc, sc.copy(), wc)
        ry, rst = R.conv1d_step(xc, sc, wc)
        return [(y, ry), (st, rst)]

    out.append(("conv1d_step", "x[2,48] Kc=4", conv))
    qd = (rng.standard_normal((2, 2, 16)) * 0.25).astype(np.float32)
    kd = (rng.standard_normal((2, 2, 16)) * 0.25).astype(np.float32)
    vd = rng.standard_normal((2, 4, 16)).astype(np.float32)
    gd = rng.uniform(0.8, 1.0, (2, 4)).astype(np.float32)
    bd = rng.uniform(0.1, 0.9, (2, 4)).astype(np.float32)
    sd = (rng.standard_normal((4, 16, 16)) * 0.1).astype(np.float32)

    def delta(ex):
        o, st = ops_seq.gated_delta(ex, qd, kd, vd, gd, bd, sd.copy())
        ro, rst = R.gated_delta(qd, kd, vd, gd, bd, sd)
        return [(o, ro), (st, rst)]

    out.append(("gated_delta", "Hk=2 Hv=4 dk=dv=16 T=2", delta))
    lg = rng.standard_normal((3, 64)).astype(np.float32)
    lg[1, 10] = lg[1, 20] = lg[1].max() + 1  # a tie: the lower index goes first

    def router(ex, norm):
        i, w = ops_seq.router_topk(ex, lg, 4, norm)
        ri, rw = R.router_topk(lg, 4, norm)
        return [("exact", i, ri), (w, rw)]

    out.append(("router_topk renorm", "logits[3,64] k=4", lambda ex: router(ex, True)))
    out.append(("router_topk", "logits[3,64] k=4", lambda ex: router(ex, False)))
    out += _glue_cases(rng)
    return out


def _glue_cases(rng):
    """glue.metal: what the device-resident decode step runs between the kernels above."""
    from ...quant.bf16 import f32_to_bf16
    from . import ops_glue as G

    a = rng.standard_normal(300).astype(np.float32)
    b = rng.standard_normal(300).astype(np.float32)
    xg = rng.standard_normal((5, 24)).astype(np.float32)
    gt = (rng.standard_normal(5 * 48) * 4).astype(np.float32)
    bb = (rng.standard_normal(40) * 30).astype(np.float32)
    aa = (rng.standard_normal(40) * 30).astype(np.float32)
    A = np.exp(rng.standard_normal(40) * 0.5).astype(np.float32)
    dt = rng.standard_normal(40).astype(np.float32)
    xl = rng.standard_normal((3, 200)).astype(np.float32)
    src = rng.standard_normal(97).astype(np.float32)
    idx = rng.integers(0, 97, 260).astype(np.int32)
    w32 = rng.standard_normal((37, 100)).astype(np.float32)
    wbf = f32_to_bf16(w32)
    xm = rng.standard_normal((2, 100)).astype(np.float32)
    ids = np.array([3, 0, 36], np.int32)
    return [
        ("add", "n=300", lambda ex: [(G.add(ex, a, b), G.add_ref(a, b))]),
        ("swiglu", "n=300", lambda ex: [(G.swiglu(ex, a, b), G.swiglu_ref(a, b))]),
        ("sigmoid_gate", "x[5,24] gate stride 48", lambda ex: [(G.sigmoid_gate(ex, xg, gt, 48, 24),
                                                                G.sigmoid_gate_ref(xg, gt, 48, 24))]),
        ("gdn_gates", "n=40, logits in both tails", lambda ex: list(zip(G.gdn_gates(ex, bb, aa, A, dt),
                                                                        G.gdn_gates_ref(bb, aa, A, dt)))),
        ("l2norm_scale", "x[3,200]", lambda ex: [(G.l2norm_scale(ex, xl, 1, 200 ** -0.5, 1.0, 1e-6),
                                                  G.l2norm_scale_ref(xl, 1, 200 ** -0.5, 1.0, 1e-6))]),
        ("gather", "src[97] idx[260]", lambda ex: [("exact", G.gather(ex, src, idx), G.gather_ref(src, idx))]),
        ("matvec bf16 weights", "x[2,100] W[37,100]", lambda ex: [(G.matvec(ex, xm, wbf, "BF16"),
                                                                   G.matvec_ref(xm, wbf, "BF16"))]),
        ("embed_rows bf16", "V=37 D=100 ids[3]", lambda ex: [("exact", G.embed_rows(ex, ids, wbf, "BF16"),
                                                              G.embed_rows_ref(ids, wbf, "BF16"))]),
    ]


def run_selftest(executor: Executor, seed: int = 0) -> list[CaseResult]:
    results = []
    for op, shapes, fn in cases(seed):
        t0 = time.perf_counter()
        try:
            worst = 0.0
            ok = True
            for pair in fn(executor):
                if isinstance(pair[0], str):  # ("exact", result, reference): integers, must be equal
                    _, a, b = pair
                    if not np.array_equal(np.asarray(a), np.asarray(b)):
                        ok = False
                        worst = float("inf")
                else:
                    worst = max(worst, _rel(*pair))
            ok = ok and worst <= TOL
            results.append(CaseResult(op, shapes, ok, worst, TOL, time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - a failing kernel is a result to report, not a crash
            msg = f"{type(e).__name__}: {getattr(e, 'message', None) or e}"
            results.append(CaseResult(op, shapes, False, None, TOL, time.perf_counter() - t0,
                                      msg.splitlines()[0][:300] if msg else traceback.format_exc(limit=1)))
    return results


def environment(executor: Executor) -> dict:
    env = {"moepack": __version__, "executor": executor.name, "python": sys.version.split()[0],
           "platform": platform.platform(), "machine": platform.machine()}
    dev = getattr(executor, "device", None)
    if dev is not None:
        try:
            env["device"] = str(dev.name())
        except Exception:  # noqa: BLE001
            env["device"] = str(dev)
    describe = getattr(executor, "describe", None)
    if callable(describe):
        try:  # the report is what a first user pastes into an issue: it must come out even if this fails
            env.update(describe())
        except Exception as e:  # noqa: BLE001
            env["describe_error"] = f"{type(e).__name__}: {e}"
    return env


def report(env: dict, results: list[CaseResult]) -> dict:
    return {"environment": env, "passed": sum(r.ok for r in results), "failed": sum(not r.ok for r in results),
            "cases": [asdict(r) for r in results]}
