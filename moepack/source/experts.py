"""Finding and reading a layer's routed experts in a source checkpoint, a slice of experts at a time.

Two source kinds:
  * MLX quantized: stacked `switch_mlp.{proj}_proj.{weight,scales,biases}` [E, out, in*bits/32] uint32 and
    [E, out, in/gs] bf16. Expert e of a stacked tensor is one contiguous byte range, so a slice of
    experts is one pread: memory stays bounded by the slice, not the layer.
  * Hugging Face float (bf16/fp16/fp32): per-expert `experts.{e}.{proj}_proj.weight` [out, in], or fused
    `experts.gate_up_proj` [E, 2I, D] (gate rows first) and `experts.down_proj` [E, D, I].
Shape legend: E=experts, n=experts in a slice, D=hidden, I=moe intermediate, gs=group size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..archs.base import PROJS, Architecture, MoeShape
from ..errors import CorruptFileError, QuantizationError, ShapeError, SourceError
from .safetensors_file import DTYPES

FLOAT_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class Slice:
    """A byte range of one source file: `count` items of `item_bytes` starting at `start`."""

    file: str
    start: int
    item_bytes: int


@dataclass(frozen=True)
class QuantProj:
    """One projection of an MLX-quantized layer: stacked weight/scales/biases."""

    proj: str
    bits: int
    group_size: int
    out: int
    inp: int
    tensors: dict  # part -> TensorInfo
    files: dict  # part -> path


@dataclass(frozen=True)
class FloatProj:
    """One projection of an unquantized HF layer: per-expert ranges (fused or per-expert tensors)."""

    proj: str
    dtype: str  # safetensors dtype
    out: int
    inp: int
    ranges: tuple  # per expert: (path, start byte)


@dataclass(frozen=True)
class LayerExperts:
    layer: int
    kind: str  # "mlx" | "hf"
    projs: dict  # proj -> QuantProj | FloatProj

    @property
    def source_bits(self) -> dict[str, int] | None:
        if self.kind != "mlx":
            return None
        return {p: q.bits for p, q in self.projs.items()}

    @property
    def group_size(self) -> int | None:
        if self.kind != "mlx":
            return None
        return self.projs["gate"].group_size

    def source_bytes(self, num_experts: int) -> int:
        total = 0
        for q in self.projs.values():
            if isinstance(q, QuantProj):
                total += sum(t.nbytes for t in q.tensors.values())
            else:
                total += num_experts * q.out * q.inp * DTYPES[q.dtype][1]
        return total


def find_expert_layers(ckpt, arch: Architecture) -> tuple[str, list[int]]:
    """('mlx'|'hf', sorted MoE layer indices) from the checkpoint's tensor names."""
    mlx = sorted({arch.expert_layer_of(n) for n in ckpt.tensor_names} - {None})
    if mlx:
        return "mlx", mlx
    hf = sorted({arch.hf_expert_layer_of(n) for n in ckpt.tensor_names} - {None})
    if hf:
        return "hf", hf
    raise SourceError(
        f"no routed-expert tensors found (looked for names like {arch.expert_name(0, 'gate', 'weight')!r} "
        f"or {arch.hf_expert_tensor.format(layer=0, expert=0, proj='gate')!r})",
        hint="is this an MoE checkpoint of the architecture its config.json names?",
    )


def _info(ckpt, name: str):
    try:
        return ckpt.info(name)
    except KeyError:
        raise SourceError(f"tensor {name} is missing from the checkpoint",
                          hint="the download may be incomplete; fetch the checkpoint again") from None


def plan_mlx_layer(ckpt, arch: Architecture, shape: MoeShape, layer: int, default_gs: int | None) -> LayerExperts:
    projs = {}
    for proj in PROJS:
        out, inp = shape.proj_shape(proj)
        t = {part: _info(ckpt, arch.expert_name(layer, proj, part)) for part in ("weight", "scales", "biases")}
        w, s, b = t["weight"], t["scales"], t["biases"]
        E = shape.num_experts
        if w.dtype != "U32" or len(w.shape) != 3 or w.shape[:2] != (E, out):
            raise ShapeError(f"{w.name}: {w.dtype} {list(w.shape)}, expected U32 [{E}, {out}, in*bits/32]")
        for x in (s, b):
            if x.dtype != "BF16":
                raise ShapeError(f"{x.name}: dtype {x.dtype}, expected BF16 (fp16/fp32 scales are not supported yet)")
            if x.shape != s.shape or len(x.shape) != 3 or x.shape[:2] != (E, out) or x.shape[2] == 0:
                raise ShapeError(f"{x.name}: shape {list(x.shape)}, expected [{E}, {out}, in/group_size]")
        if inp % s.shape[2]:
            raise ShapeError(f"{s.name}: {s.shape[2]} groups do not divide the input dim {inp}")
        gs = inp // s.shape[2]
        if (w.shape[2] * 32) % inp:
            raise ShapeError(f"{w.name}: {w.shape[2]} words per row do not hold {inp} codes of whole bits")
        bits = w.shape[2] * 32 // inp
        if bits not in (2, 3, 4, 5, 6, 8):
            raise ShapeError(f"{w.name}: implies {bits} bits per weight, which MLX affine does not use")
        if default_gs is not None and gs != default_gs and gs not in (32, 64, 128):
            raise ShapeError(f"{s.name}: implies group size {gs}")
        projs[proj] = QuantProj(proj, bits, gs, out, inp, t, {k: ckpt.file_of(v.name) for k, v in t.items()})
    gss = {q.group_size for q in projs.values()}
    if len(gss) != 1:
        raise QuantizationError(f"layer {layer}: projections use different group sizes {sorted(gss)}")
    return LayerExperts(layer, "mlx", projs)


def plan_hf_layer(ckpt, arch: Architecture, shape: MoeShape, layer: int) -> LayerExperts:
    E = shape.num_experts
    names = set(ckpt.tensor_names)
    fused_gu = arch.hf_fused_gate_up.format(layer=layer) if arch.hf_fused_gate_up else None
    projs = {}
    if fused_gu and fused_gu in names:
        gu = _info(ckpt, fused_gu)
        dn = _info(ckpt, arch.hf_fused_down.format(layer=layer))
        I, D = shape.moe_intermediate, shape.hidden
        for t, want in ((gu, (E, 2 * I, D)), (dn, (E, D, I))):
            if t.dtype not in FLOAT_DTYPES or tuple(t.shape) != want:
                raise ShapeError(f"{t.name}: {t.dtype} {list(t.shape)}, expected float {list(want)}")
        isz = DTYPES[gu.dtype][1]
        gf, df = ckpt.file_of(gu.name), ckpt.file_of(dn.name)
        per = 2 * I * D * isz
        projs["gate"] = FloatProj("gate", gu.dtype, I, D, tuple((gf, gu.start + e * per) for e in range(E)))
        projs["up"] = FloatProj("up", gu.dtype, I, D, tuple((gf, gu.start + e * per + I * D * isz) for e in range(E)))
        projs["down"] = FloatProj("down", dn.dtype, D, I,
                                  tuple((df, dn.start + e * D * I * DTYPES[dn.dtype][1]) for e in range(E)))
        return LayerExperts(layer, "hf", projs)
    for proj in PROJS:
        out, inp = shape.proj_shape(proj)
        ranges, dtypes = [], set()
        for e in range(E):
            t = _info(ckpt, arch.hf_expert_tensor.format(layer=layer, expert=e, proj=proj))
            if t.dtype not in FLOAT_DTYPES or tuple(t.shape) != (out, inp):
                raise ShapeError(f"{t.name}: {t.dtype} {list(t.shape)}, expected float [{out}, {inp}]")
            dtypes.add(t.dtype)
            ranges.append((ckpt.file_of(t.name), t.start))
        if len(dtypes) != 1:
            raise ShapeError(f"layer {layer} {proj}: experts stored in mixed dtypes {sorted(dtypes)}")
        projs[proj] = FloatProj(proj, dtypes.pop(), out, inp, tuple(ranges))
    return LayerExperts(layer, "hf", projs)


class FileReader:
    """pread access to source files with one cached descriptor per file (thread-safe: pread has no seek)."""

    def __init__(self):
        self._fds: dict[str, int] = {}

    def pread(self, path: str, start: int, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, dtype=np.uint8)
        self.preadv(path, [buf], start)
        return buf

    def preadv(self, path: str, views: list, start: int) -> None:
        """Scatter-read len(views) consecutive byte ranges starting at `start` into `views` (uint8 arrays)."""
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds.setdefault(path, os.open(path, os.O_RDONLY))
        bufs = [memoryview(v) for v in views]
        want = sum(len(b) for b in bufs)
        done = 0
        while bufs:
            n = os.preadv(fd, bufs, start + done)
            if n == 0:
                raise CorruptFileError(f"{path} is truncated: wanted {want} bytes at offset {start}")
            done += n
            while bufs and n >= len(bufs[0]):  # drop the filled buffers, trim a partly filled one
                n -= len(bufs[0])
                bufs.pop(0)
            if bufs and n:
                bufs[0] = bufs[0][n:]

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def read_quant_slice(reader: FileReader, q: QuantProj, e0: int, e1: int):
    """Experts e0..e1-1 of one projection: (weight uint32 [n, out, w], scales u16 [n, out, g], biases)."""
    out = []
    for part in ("weight", "scales", "biases"):
        t = q.tensors[part]
        per = t.nbytes // t.shape[0]
        raw = reader.pread(q.files[part], t.start + e0 * per, (e1 - e0) * per)
        dt = np.uint32 if part == "weight" else np.uint16
        out.append(raw.view(dt).reshape((e1 - e0,) + tuple(t.shape[1:])))
    return tuple(out)


def read_float_slice(reader: FileReader, f: FloatProj, e0: int, e1: int) -> np.ndarray:
    """Experts e0..e1-1 of one projection as float32 [n, out, in]."""
    isz = DTYPES[f.dtype][1]
    n = f.out * f.inp * isz
    res = np.empty((e1 - e0, f.out, f.inp), dtype=np.float32)
    for i, e in enumerate(range(e0, e1)):
        path, start = f.ranges[e]
        raw = reader.pread(path, start, n)
        res[i] = to_float32(raw, f.dtype).reshape(f.out, f.inp)
    return res


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "F32":
        return raw.view(np.float32).copy()
    raise ShapeError(f"cannot read dtype {dtype} as float")
