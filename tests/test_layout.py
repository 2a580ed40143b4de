"""The record layout, checked by hand and against Flash-MoE's published 397B offsets."""

import json

import pytest

from moepack.archs.base import MoeShape
from moepack.errors import PackedModelError, QuantizationError
from moepack.layout.constants import layer_file_name
from moepack.layout.record import RecordLayout, record_layout

Q397 = MoeShape(num_layers=60, num_experts=512, experts_per_token=10, hidden=4096, moe_intermediate=1024)


def test_qwen397_4bit_offsets_match_flash_moe():
    lay = record_layout(Q397, 4, 64)
    # Flash-MoE packed_experts offsets (CONTEXT.md): gate w/s/b, up w/s/b, down w/s/b
    assert [c.offset for c in lay.components] == [
        0, 2_097_152, 2_228_224, 2_359_296, 4_456_448, 4_587_520, 4_718_592, 6_815_744, 6_946_816]
    assert lay.record_size == 7_077_888 == 432 * 16384  # no padding needed
    assert lay.payload_size == lay.record_size
    assert lay.component("gate.weight").shape == (1024, 512)  # 4096 codes * 4 bits / 32
    assert lay.component("down.scales").shape == (4096, 16)  # 1024 / 64 groups
    assert lay.key == "q4.g64"


def test_qwen397_2bit_record():
    lay = record_layout(Q397, 2, 64)
    # weights 3 x 1024*4096*2/8 = 3 x 1,048,576; scales+biases 6 x 131,072
    assert lay.record_size == 3 * 1_048_576 + 6 * 131_072 == 3_932_160 == 240 * 16384


def test_small_record_is_padded_to_16k():
    # D=128, I=64, 4-bit, group 64: gate w [64, 16] u32 = 4096 B, scales/biases [64, 2] bf16 = 256 B each
    # -> gate 4608, up 4608, down w [128, 8] u32 = 4096 + 2 x [128, 1] bf16 = 512 -> 4608; payload 13,824
    lay = record_layout(MoeShape(2, 8, 2, 128, 64), 4, 64)
    assert lay.payload_size == 13_824
    assert lay.record_size == 16_384
    assert [c.offset for c in lay.components][:4] == [0, 4096, 4352, 4608]


def test_mixed_bits_key_and_roundtrip():
    lay = record_layout(Q397, {"gate": 4, "up": 4, "down": 8}, 64)
    assert lay.key == "gate:q4.g64,up:q4.g64,down:q8.g64"
    again = RecordLayout.from_json(json.loads(json.dumps(lay.to_json())))
    assert again == lay


def test_layout_with_a_hole_is_refused():
    d = record_layout(Q397, 4, 64).to_json()
    d["components"][1]["offset"] += 16
    with pytest.raises(PackedModelError):
        RecordLayout.from_json(d)


def test_group_size_must_divide():
    with pytest.raises(QuantizationError):
        record_layout(MoeShape(2, 8, 2, 96, 64), 4, 64)


def test_layer_file_names():
    assert layer_file_name(3, 60) == "packed_experts/layer_03.bin"
    assert layer_file_name(3, 120) == "packed_experts/layer_003.bin"
    assert layer_file_name(99, 100) == "packed_experts/layer_99.bin"
