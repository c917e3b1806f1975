#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors header fuzz test (tests/io/safetensors_fuzz_test.cpp).

ok_*.safetensors must parse; bad_*.safetensors must be refused with an lcx::Error. The fuzz test
mutates all of them. Plain Python (struct, json), so it runs anywhere: python3 make_corpus.py
"""
import json
import struct


def image(header, data, pad=True):
    text = json.dumps(header, separators=(",", ":"))
    if pad:
        text += " " * ((8 - len(text) % 8) % 8)
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + data


def f32(*v):
    return struct.pack("<%df" % len(v), *v)


def write(name, blob):
    with open(name, "wb") as f:
        f.write(blob)


two = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
       "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}}
bf = struct.pack("<3H", 0x3F80, 0x4000, 0xC040)
write("ok_two_tensors.safetensors", image(two, f32(1, 2, 3, 4) + bf))
write("ok_metadata.safetensors", image({"__metadata__": {"format": "pt"},
                                        "x": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}},
                                       struct.pack("<2q", 7, -1)))
write("ok_empty.safetensors", image({}, b""))
write("ok_zero_size.safetensors", image({"z": {"dtype": "F16", "shape": [0, 4], "data_offsets": [0, 0]},
                                         "s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, f32(5)))
write("bad_truncated.safetensors", image(two, f32(1, 2, 3, 4) + bf)[:-3])
write("bad_header_too_long.safetensors", struct.pack("<Q", 1 << 20) + b'{"a":1}')
write("bad_overlap.safetensors", image({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, f32(1, 2, 3)))
write("bad_gap.safetensors", image({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, f32(1, 2)))
write("bad_byte_count.safetensors", image({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, f32(1, 2)))
write("bad_dtype.safetensors", image({"a": {"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}}, f32(1, 2)))
write("bad_negative_shape.safetensors", image({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, f32(1, 2)))
write("bad_json.safetensors", struct.pack("<Q", 8) + b'{"a":{"d' + f32(1))
dup = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
write("bad_duplicate.safetensors", struct.pack("<Q", len(dup)) + dup + f32(1))
write("bad_short.safetensors", b"\x05\x00\x00")
