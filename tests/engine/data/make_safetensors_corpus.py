#!/usr/bin/env python3
"""Writes the safetensors test corpus into tests/engine/data/safetensors/.

Each bad_*.safetensors breaks exactly one rule of the format; tests/engine/safetensors_test.cpp
holds the error fragment each must raise (and fails if a file here has no entry there).
Each good_*.safetensors is legal but unusual (padding, misalignment, odd bool bytes, ...).
The files are small so the directory can seed a fuzzer. Only the standard library is used:
    python3 tests/engine/data/make_safetensors_corpus.py
"""
import json
import os
import struct
import sys

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safetensors")


def file_bytes(header, data=b"", length=None):
    """8-byte little-endian header length, the header, the byte buffer."""
    if isinstance(header, str):
        header = header.encode("utf-8")
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def hdr(obj):
    return json.dumps(obj, separators=(",", ":"))


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


F32_2 = struct.pack("<2f", 1.0, 2.0)  # 8 bytes

BAD = {
    # --- the 8-byte length ---
    "bad_empty_file": b"",
    "bad_too_short": b"\x05\x00\x00\x00\x00",
    "bad_header_over_limit": file_bytes(b"{}", length=100_000_001),
    "bad_header_length_max_u64": file_bytes(b"{}", length=2**64 - 1),
    "bad_header_past_eof": file_bytes(b"{}", length=1000),
    # --- the JSON text ---
    "bad_header_empty": file_bytes(b""),
    "bad_not_json": file_bytes("{abc"),
    "bad_truncated_json": file_bytes('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]'),
    "bad_nul_padding": file_bytes(b"{}\x00\x00\x00\x00\x00\x00"),
    "bad_invalid_utf8": file_bytes(b'{"w\xff":' + hdr(entry("F32", [2], 0, 8)).encode() + b"}", F32_2),
    "bad_overlong_utf8": file_bytes(b'{"\xc0\xaf":' + hdr(entry("F32", [2], 0, 8)).encode() + b"}", F32_2),
    "bad_header_array": file_bytes("[1,2]"),
    "bad_header_string": file_bytes('"abc"'),
    "bad_deep_nesting": file_bytes("[" * 3000 + "]" * 3000),
    # --- entries ---
    "bad_entry_not_object": file_bytes(hdr({"w": 3})),
    "bad_missing_dtype": file_bytes(hdr({"w": {"shape": [2], "data_offsets": [0, 8]}}), F32_2),
    "bad_missing_shape": file_bytes(hdr({"w": {"dtype": "F32", "data_offsets": [0, 8]}}), F32_2),
    "bad_missing_offsets": file_bytes(hdr({"w": {"dtype": "F32", "shape": [2]}}), F32_2),
    "bad_dtype_not_string": file_bytes(hdr({"w": entry(7, [2], 0, 8)}), F32_2),
    "bad_unknown_dtype": file_bytes(hdr({"w": entry("F33", [2], 0, 8)}), F32_2),
    "bad_unsupported_dtype": file_bytes(hdr({"w": entry("U8", [8], 0, 8)}), F32_2),
    "bad_shape_not_array": file_bytes(hdr({"w": entry("F32", 2, 0, 8)}), F32_2),
    "bad_shape_negative": file_bytes(hdr({"w": entry("F32", [-2], 0, 8)}), F32_2),
    "bad_shape_fraction": file_bytes(hdr({"w": entry("F32", [2.5], 0, 8)}), F32_2),
    "bad_shape_float": file_bytes('{"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', F32_2),
    "bad_shape_string": file_bytes(hdr({"w": entry("F32", ["2"], 0, 8)}), F32_2),
    "bad_shape_huge_number": file_bytes('{"w":{"dtype":"F32","shape":[100000000000000000000000],"data_offsets":[0,8]}}', F32_2),
    "bad_shape_over_int64": file_bytes(hdr({"w": entry("F32", [2**63], 0, 8)}), F32_2),
    "bad_numel_overflow": file_bytes(hdr({"w": entry("F32", [2**32, 2**32], 0, 8)}), F32_2),
    "bad_offsets_one": file_bytes(hdr({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}), F32_2),
    "bad_offsets_three": file_bytes(hdr({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}}), F32_2),
    "bad_offsets_object": file_bytes(hdr({"w": {"dtype": "F32", "shape": [2], "data_offsets": {"a": 0}}}), F32_2),
    "bad_offsets_negative": file_bytes(hdr({"w": entry("F32", [2], -8, 0)}), F32_2),
    "bad_offsets_float": file_bytes(hdr({"w": entry("F32", [2], 0, 8.5)}), F32_2),
    "bad_offsets_reversed": file_bytes(hdr({"w": entry("F32", [0], 8, 0)}), F32_2),
    "bad_size_mismatch": file_bytes(hdr({"w": entry("F32", [3], 0, 8)}), F32_2),
    "bad_offsets_past_buffer": file_bytes(hdr({"w": entry("F32", [4], 0, 16)}), F32_2),
    "bad_offsets_huge": file_bytes(hdr({"w": entry("BOOL", [2**62], 2**62, 2**63)}), F32_2),
    # --- the byte buffer as a whole ---
    "bad_first_not_at_zero": file_bytes(hdr({"w": entry("F32", [1], 4, 8)}), F32_2),
    "bad_gap": file_bytes(hdr({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}), F32_2 + b"\0" * 4),
    "bad_overlap": file_bytes(hdr({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}), F32_2 + b"\0" * 4),
    "bad_trailing_bytes": file_bytes(hdr({"w": entry("F32", [1], 0, 4)}), F32_2),
    "bad_trailing_bytes_no_tensors": file_bytes("{}", b"\0" * 4),
    # --- names and metadata ---
    "bad_duplicate_name": file_bytes(
        '{"w":' + hdr(entry("F32", [1], 0, 4)) + ',"w":' + hdr(entry("F32", [1], 4, 8)) + "}", F32_2),
    "bad_duplicate_field": file_bytes('{"w":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}}', F32_2),
    "bad_metadata_string": file_bytes(hdr({"__metadata__": "x"})),
    "bad_metadata_number_value": file_bytes(hdr({"__metadata__": {"format": 1}})),
    "bad_metadata_nested": file_bytes(hdr({"__metadata__": {"format": {"a": "b"}}})),
    "bad_metadata_duplicate_key": file_bytes('{"__metadata__":{"k":"a","k":"b"}}'),
}

UNALIGNED = hdr({"w": entry("F32", [2], 0, 8)})
UNALIGNED += " " * ((1 - len(UNALIGNED)) % 4)

GOOD = {
    # Header padded with spaces far past 8-byte alignment (legal).
    "good_padded": file_bytes(hdr({"w": entry("F32", [2], 0, 8)}) + " " * 37, F32_2),
    # Header length 1 mod 4: the F32 data starts misaligned for a mapped float.
    "good_unaligned": file_bytes(UNALIGNED, F32_2),
    # True stored as 2 and 255 (other writers do this); read back as 1.
    "good_bool_bytes": file_bytes(hdr({"m": entry("BOOL", [4], 0, 4)}) + "  ", bytes([0, 1, 2, 255])),
    "good_empty": file_bytes("{}      "),
    "good_metadata_only": file_bytes(hdr({"__metadata__": {"format": "pt", "note": "caf\u00e9"}})),
    # Two empty tensors sharing offset 8 around real ones, an extra unknown field, and a
    # non-ASCII name (stored as raw UTF-8 and as a \\u escape).
    "good_mixed": file_bytes(
        '{"b":{"dtype":"I32","shape":[1],"data_offsets":[8,12],"extra":[1,2]},'
        '"e0":{"dtype":"F64","shape":[0,3],"data_offsets":[8,8]},'
        '"\\u00e9t\u00e9":{"dtype":"F16","shape":[],"data_offsets":[12,14]},'
        '"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},'
        '"e1":{"dtype":"BF16","shape":[2,0],"data_offsets":[8,8]}}',
        struct.pack("<q", -5) + struct.pack("<i", 7) + struct.pack("<H", 0x3C00)),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for name in os.listdir(OUT):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(OUT, name))
    total = 0
    for name, data in {**BAD, **GOOD}.items():
        with open(os.path.join(OUT, name + ".safetensors"), "wb") as f:
            f.write(data)
        total += len(data)
    print(f"wrote {len(BAD)} bad and {len(GOOD)} good files, {total} bytes, to {OUT}")
    if total > 100_000:
        sys.exit("corpus exceeds 100 KB")


if __name__ == "__main__":
    main()
