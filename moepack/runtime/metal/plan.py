"""The launch plan of a packed model on the Metal kernels: per layer, which kernel, which buffer at which
index, grid and threadgroup sizes, grouped into command buffers by phase.

The plan is not written out by hand: it is what the model code issues. ``launch_plan`` runs forward passes
of the real model code on a ``PlanExecutor``, which checks every dispatch against the kernel signatures
parsed from ``metal/*.metal`` (each buffer index exists, each array's dtype matches its parameter, every
parameter is given, the threadgroup fits 1024 threads) and records it, without running any kernel.
Outputs are set to zero (integer outputs to 0..n-1 along their last axis, so the router "picks" experts
0..k-1 for every token): the launches are those of real routing, since no shape depends on which experts
are picked.

Command buffers, in order, per forward call (the phases the model code marks; on a GPU each is one
commit): ``embed``; per layer ``attention`` (norm, projections, q/k norm, RoPE, attention or the
Gated-DeltaNet conv/delta step, output projection), ``routing`` (norm, router matvec, softmax + top-k:
the CPU then issues the expert reads), ``experts`` (shared expert, each routed expert's fused gate/up +
SwiGLU and down projection straight from its record); ``head`` (final norm, lm_head).

``resident_plan`` records the device-resident decode step (``resident.py``, what GPU backends run for decode)
the same way: its command buffers (a layer's experts + the next layer's attention and routing each), the
launches of each and what the host reads back after it (top-k ids + weights, and the logits at the end).

    python -m moepack.runtime.metal.plan PACKED [--tokens 1] [--json]
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ...errors import MoepackError
from .dispatch import Dispatch, HostBuffers, KernelError, resolve_host_args
from .signature import KernelSignature, parse_kernels
from .sources import read_source

MAX_THREADS = 1024


class PlanExecutor(HostBuffers):
    """Validates and records dispatches; runs nothing (name "plan"). DeviceBuffers live in host memory, as
    the emulator's (the resident decode step's plan)."""

    name = "plan"

    def __init__(self):
        self._sigs: dict[str, dict[str, KernelSignature]] = {}
        self.checked = 0

    def signature(self, source: str, kernel: str) -> KernelSignature:
        sigs = self._sigs.get(source)
        if sigs is None:
            path, text = read_source(source)
            sigs = self._sigs[source] = parse_kernels(text, path.name)
        if kernel not in sigs:
            raise KernelError(f"{source} has no kernel {kernel!r}", hint=f"it has {', '.join(sorted(sigs))}")
        return sigs[kernel]

    def check(self, d: Dispatch) -> None:
        sig = self.signature(d.source, d.kernel)
        want = {p.index for p in sig.params if p.index is not None}
        if set(d.args) != want:
            raise KernelError(f"{d.kernel}: dispatch gives buffers {sorted(d.args)}, the kernel takes {sorted(want)}")
        for i, v in d.args.items():
            p = sig.buffers[i]
            if p.kind == "buffer":
                if not isinstance(v, np.ndarray):
                    raise KernelError(f"{d.kernel}: buffer({i}) {p.name} needs an array, got {type(v).__name__}")
                if p.dtype is not None and v.dtype != p.dtype:
                    raise KernelError(f"{d.kernel}: buffer({i}) {p.name} is {p.type}, got a {v.dtype} array")
            elif isinstance(v, np.ndarray) and v.size != p.width:
                raise KernelError(f"{d.kernel}: buffer({i}) {p.name} is a constant {p.base}, got an array")
        if any(g < 1 for g in d.grid) or any(t < 1 for t in d.threadgroup):
            raise KernelError(f"{d.kernel}: empty grid {d.grid} / threadgroup {d.threadgroup}")
        if int(np.prod(d.threadgroup)) > MAX_THREADS:
            raise KernelError(f"{d.kernel}: threadgroup {d.threadgroup} exceeds {MAX_THREADS} threads")
        self.checked += 1

    def run(self, dispatches: Sequence[Dispatch]) -> None:
        if isinstance(dispatches, Dispatch):
            dispatches = [dispatches]
        for d in dispatches:
            d = resolve_host_args(d)
            self.check(d)
            sig = self.signature(d.source, d.kernel)
            for i, v in d.args.items():  # outputs: floats 0, integers 0..n-1 along the last axis (k distinct
                if sig.buffers[i].writable:  # experts per token from the router, as real routing gives)
                    if v.dtype.kind in "iu" and v.ndim:
                        v[...] = np.arange(v.size).reshape(v.shape) % v.shape[-1]
                    else:
                        v[...] = 0


@dataclass
class CommandBuffer:
    layer: int | None
    phase: str
    launches: list = field(default_factory=list)  # backend.Launch

    def to_json(self) -> dict:
        return {"layer": self.layer, "phase": self.phase, "launches": [x.to_json() for x in self.launches]}


def group(launches) -> list[CommandBuffer]:
    """Consecutive launches of one (layer, phase) form one command buffer."""
    out: list[CommandBuffer] = []
    for x in launches:
        if not out or (out[-1].layer, out[-1].phase) != (x.layer, x.phase):
            out.append(CommandBuffer(x.layer, x.phase))
        out[-1].launches.append(x)
    return out


def launch_plan(packed, tokens: int = 1, experts_per_token: int | None = None) -> dict:
    """The launch plan of a decode step after a `tokens`-token prefill (both recorded, nothing executed)."""
    from ..model import Model
    from ...layout.reader import PackedModel
    from .backend import GpuKernels

    pm = PackedModel(packed) if not isinstance(packed, PackedModel) else packed
    try:
        model = Model(pm, backend="numpy", experts_per_token=experts_per_token)
        gk = GpuKernels(PlanExecutor())
        model.K = gk
        model._ctx.K = gk
        try:
            cache = model.new_cache()
            model.forward(np.arange(tokens) % model.vocab_size, cache)
            n_prefill = len(gk.log.launches)
            model.forward(np.array([1 % model.vocab_size]), cache)
        finally:
            model.close()
    finally:
        if pm is not packed:
            pm.close()
    prefill, decode = gk.log.launches[:n_prefill], gk.log.launches[n_prefill:]
    kernels = OrderedDict()
    for x in decode:
        kernels[x.kernel] = kernels.get(x.kernel, 0) + 1
    cbs = group(decode)
    return {"prefill_tokens": tokens, "prefill_launches": len(prefill), "decode_launches": len(decode),
            "decode_command_buffers": len(cbs), "decode_kernels": dict(kernels), "cpu_fallbacks": gk.cpu_fallbacks,
            "decode": [cb.to_json() for cb in cbs], "resident": resident_plan(packed, tokens, experts_per_token)}


def resident_plan(packed, tokens: int = 1, experts_per_token: int | None = None) -> dict:
    """The device-resident decode step (metal/resident.py) after a `tokens`-token prefill, recorded on a
    PlanExecutor: its command buffers, the launches of each and what the host reads back after it."""
    from ..model import Model
    from ...layout.reader import PackedModel
    from .backend import GpuKernels
    from .resident import ResidentDecoder, ResidentUnsupported

    pm = PackedModel(packed) if not isinstance(packed, PackedModel) else packed
    try:
        model = Model(pm, backend="numpy", experts_per_token=experts_per_token)
        try:
            gk = GpuKernels(PlanExecutor())
            model.K = gk
            model._ctx.K = gk
            cache = model.new_cache()
            model.forward(np.arange(tokens) % model.vocab_size, cache)
            try:
                rd = ResidentDecoder(model)
            except ResidentUnsupported as e:
                return {"supported": False, "why": e.message}
            rd.trace = []
            rd.step(1 % model.vocab_size, cache)
        finally:
            model.close()
    finally:
        if pm is not packed:
            pm.close()
    s = rd.last_step
    return {"supported": True, "command_buffers": s["command_buffers"], "launches": s["launches"],
            "read_backs": s["readbacks"], "uploads_first_step": s["uploads"], "buffers": rd.trace}


def format_plan(plan: dict) -> str:
    lines = [f"decode step: {plan['decode_launches']} launches in {plan['decode_command_buffers']} command buffers "
             f"(prefill of {plan['prefill_tokens']} token(s): {plan['prefill_launches']} launches)"]
    for cb in plan["decode"]:
        where = "model" if cb["layer"] is None else f"layer {cb['layer']}"
        lines.append(f"[{where} · {cb['phase']}]")
        for x in cb["launches"]:
            bufs = " ".join(f"{k}:{v}" for k, v in x["buffers"].items())
            lines.append(f"  {x['source']:<24}{x['kernel']:<22} grid {tuple(x['grid'])} tg {tuple(x['threadgroup'])}"
                         f"  {bufs}")
    res = plan.get("resident")
    if res is not None and not res.get("supported"):
        lines.append(f"resident decode step: not available ({res.get('why')}); decode uses the plan above")
    elif res is not None:
        lines.append(f"resident decode step (device-resident state; used by --backend metal/cuda/metal-emu unless "
                     f"MOEPACK_RESIDENT=0): {res['launches']} launches in {res['command_buffers']} command buffers, "
                     f"{res['read_backs']} read-backs")
        for n, cb in enumerate(res["buffers"]):
            spans = []
            for x in cb["launches"]:
                where = "model" if x["layer"] is None else f"layer {x['layer']}"
                tag = f"{where} {x['phase']}"
                if not spans or spans[-1][0] != tag:
                    spans.append([tag, 0])
                spans[-1][1] += 1
            back = f"  -> read back {', '.join(cb['read_back'])}" if cb["read_back"] else ""
            lines.append(f"  [{n}] " + ", ".join(f"{t} ({c})" for t, c in spans) + back)
    return "\n".join(lines)


def _main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m moepack.runtime.metal.plan",
                                 description="Print the Metal launch plan of a packed model's decode step.")
    ap.add_argument("packed")
    ap.add_argument("--tokens", type=int, default=1, help="prefill length before the decode step")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        plan = launch_plan(a.packed, a.tokens)
    except MoepackError as e:
        print(f"error: {e.message}")
        return 1
    print(json.dumps(plan, indent=1) if a.json else format_plan(plan))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())
