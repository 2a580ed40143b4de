"""The expert record: nine components, contiguous, padded at the end to RECORD_ALIGN.

Component order (fixed by the format): gate weight, gate scales, gate biases, up weight/scales/biases,
down weight/scales/biases. For Qwen3.5-397B at 4-bit (D=4096, I=1024, group 64) the offsets are
0, 2,097,152, 2,228,224, 2,359,296, 4,456,448, 4,587,520, 4,718,592, 6,815,744, 6,946,816 and the
record is 7,077,888 bytes (432 x 16 KiB, no padding) — byte-identical to Flash-MoE's records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..archs.base import PARTS, PROJS, MoeShape
from ..errors import PackedModelError, QuantizationError
from .constants import RECORD_ALIGN

_NP = {"uint32": np.uint32, "bfloat16": np.uint16}  # bf16 travels as uint16 bit patterns


@dataclass(frozen=True)
class Component:
    name: str  # e.g. "gate.weight"
    offset: int
    nbytes: int
    dtype: str  # "uint32" | "bfloat16"
    shape: tuple[int, ...]  # per expert: weight [out, in*bits/32], scales/biases [out, in/gs]
    bits: int
    group_size: int

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Component":
        return cls(d["name"], int(d["offset"]), int(d["nbytes"]), d["dtype"], tuple(int(s) for s in d["shape"]),
                   int(d["bits"]), int(d["group_size"]))

    def view(self, record: np.ndarray) -> np.ndarray:
        """This component as a typed array over a record's bytes (no copy)."""
        raw = record[self.offset : self.offset + self.nbytes]
        return raw.view(_NP[self.dtype]).reshape(self.shape)


@dataclass(frozen=True)
class RecordLayout:
    """Where each component sits in one expert record."""

    components: tuple[Component, ...]
    record_size: int
    alignment: int = RECORD_ALIGN

    @property
    def key(self) -> str:
        """A name carrying the recipe, e.g. 'q4.g64' or 'gate:q4.g64,up:q4.g64,down:q6.g64'."""
        recipes = {p: f"q{self.component(p + '.weight').bits}.g{self.component(p + '.weight').group_size}"
                   for p in PROJS}
        if len(set(recipes.values())) == 1:
            return recipes["gate"]
        return ",".join(f"{p}:{r}" for p, r in recipes.items())

    @property
    def payload_size(self) -> int:
        last = self.components[-1]
        return last.offset + last.nbytes

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    def proj_bits(self, proj: str) -> int:
        return self.component(f"{proj}.weight").bits

    def to_json(self) -> dict:
        return {"record_size": self.record_size, "alignment": self.alignment, "payload_size": self.payload_size,
                "components": [c.to_json() for c in self.components]}

    @classmethod
    def from_json(cls, d: dict) -> "RecordLayout":
        layout = cls(tuple(Component.from_json(c) for c in d["components"]), int(d["record_size"]),
                     int(d.get("alignment", RECORD_ALIGN)))
        layout.validate()
        return layout

    def validate(self) -> None:
        """Contiguous from 0 in the fixed order, no holes, padded size a multiple of the alignment."""
        expected = [f"{p}.{part}" for p in PROJS for part in PARTS]
        if [c.name for c in self.components] != expected:
            raise PackedModelError(f"record layout components {[c.name for c in self.components]} != {expected}")
        pos = 0
        for c in self.components:
            n = int(np.prod(c.shape)) * (4 if c.dtype == "uint32" else 2)
            if c.offset != pos or c.nbytes != n:
                raise PackedModelError(f"record component {c.name} at offset {c.offset} size {c.nbytes}; "
                                       f"expected offset {pos} size {n}")
            pos += n
        if self.alignment <= 0 or self.record_size % self.alignment or not (pos <= self.record_size < pos + self.alignment):
            raise PackedModelError(f"record size {self.record_size} is not the payload {pos} padded to {self.alignment}")


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def record_layout(shape: MoeShape, bits: dict[str, int] | int, group_size: dict[str, int] | int = 64,
                  alignment: int = RECORD_ALIGN) -> RecordLayout:
    """The record layout for one expert of `shape` with per-projection bits and group sizes."""
    comps = []
    pos = 0
    for proj in PROJS:
        b = bits[proj] if isinstance(bits, dict) else bits
        gs = group_size[proj] if isinstance(group_size, dict) else group_size
        out, inp = shape.proj_shape(proj)
        if inp % gs:
            raise QuantizationError(f"group size {gs} does not divide the {proj} projection's input dim {inp}")
        if (inp * b) % 32:
            raise QuantizationError(f"{proj} input dim {inp} at {b} bits does not fill whole uint32 words")
        parts = [("weight", "uint32", (out, inp * b // 32)), ("scales", "bfloat16", (out, inp // gs)),
                 ("biases", "bfloat16", (out, inp // gs))]
        for part, dtype, shp in parts:
            n = int(np.prod(shp)) * (4 if dtype == "uint32" else 2)
            comps.append(Component(f"{proj}.{part}", pos, n, dtype, shp, b, gs))
            pos += n
    return RecordLayout(tuple(comps), _round_up(pos, alignment), alignment)
