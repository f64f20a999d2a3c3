#!/usr/bin/env python3
"""Writes the seed inputs of every fuzz target into OUT/<target>/ (docs/FUZZING.md).

Usage: fuzz/seeds.py OUT PACK_MANIFEST
PACK_MANIFEST is trunk.manifest.json of the tiny model packed by `k3ring pack` (its pack_len
must equal PACK_LEN in tests/fuzz_replay/targets.rs).
"""
import base64
import json
import os
import struct
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TINY = os.path.join(ROOT, "tests", "fixtures", "tiny-k3")
PARTS = ["w1.weight_packed", "w1.weight_scale", "w3.weight_packed", "w3.weight_scale",
         "w2.weight_packed", "w2.weight_scale"]
SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
         "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


def safetensors(tensors, metadata=None):
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = SIZES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += bytes(n)
    js = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(js)) + js + data


def expert(layer, e):
    return [(f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{p}", "U8", [2]) for p in PARTS]


def write(out, target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def main(out, manifest_path):
    t = "safetensors_header"
    write(out, t, "two", safetensors([("a", "BF16", [2, 2]), ("b", "F32", [3])]))
    write(out, t, "meta", safetensors([("x", "U8", [4])], {"format": "pt"}))
    write(out, t, "dtypes", safetensors([(f"t{k}", k, [1, 2]) for k in SIZES]))
    write(out, t, "experts", safetensors(expert(1, 0) + expert(1, 1) + expert(2, 0)))
    write(out, t, "empty", safetensors([]))
    write(out, t, "scalar", safetensors([("s", "F64", []), ("z", "I8", [0, 5])]))

    t = "shard_index"
    one = {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}
    two = {n: "model-00002-of-00002.safetensors" for n, _, _ in expert(1, 0)}
    index = {"metadata": {"total_size": 20}, "weight_map": {**one, **two}}
    write(out, t, "valid", json.dumps(index))
    write(out, t, "compact", json.dumps({"weight_map": {**two, **one}}, separators=(",", ":")))
    write(out, t, "wrong_shard", json.dumps({"weight_map": {**one, "b": "model-00002-of-00002.safetensors", **two}}))
    write(out, t, "missing", json.dumps({"weight_map": one}))
    write(out, t, "path", json.dumps({"weight_map": {"a": "../x.safetensors"}}))

    t = "config"
    with open(os.path.join(TINY, "config.json")) as f:
        tiny = json.load(f)
    write(out, t, "tiny", json.dumps(tiny, separators=(",", ":")))
    with open(os.path.join(ROOT, "tests", "fixtures", "k3-config.json")) as f:
        k3 = json.load(f)
    write(out, t, "k3", json.dumps(k3, separators=(",", ":")))
    flat = {k: v for k, v in tiny.items() if k != "text_config"}
    flat.update(tiny["text_config"])
    write(out, t, "flat", json.dumps(flat, separators=(",", ":")))
    write(out, t, "empty_object", "{}")
    write(out, t, "nested_only", json.dumps({"text_config": {"linear_attn_config": {}}}))

    t = "tiktoken_vocab"
    with open(os.path.join(TINY, "tiktoken.model"), "rb") as f:
        write(out, t, "tiny", f.read())
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    write(out, t, "bytes", "\n".join(lines) + "\n")
    merges = lines + [f"{base64.b64encode(s).decode()} {256 + i}" for i, s in enumerate([b"ab", b"abc", b" t", b"\xe6\xbc"])]
    write(out, t, "merges", "\n".join(merges))
    write(out, t, "short", "YQ== 0\nYg== 1\n")
    write(out, t, "crlf", "\r\n".join(lines[:8]) + "\r\n\r\n")

    t = "tokenizer_config"
    with open(os.path.join(TINY, "tokenizer_config.json")) as f:
        tc = json.load(f)
    few = dict(list(tc["added_tokens_decoder"].items())[:6])
    write(out, t, "tiny_few", json.dumps({"added_tokens_decoder": few}))
    write(out, t, "minimal", json.dumps({"added_tokens_decoder": {"300": {"content": "[BOS]"}, "301": {"content": "<|im_end|>"}}}))
    write(out, t, "overlap", json.dumps({"added_tokens_decoder": {"400": {"content": "ab"}, "401": {"content": "abc"}, "402": {"content": "b"}}}))
    write(out, t, "unicode", json.dumps({"added_tokens_decoder": {"256": {"content": "漢字"}, "9999": {"content": "\U0001F600"}}}, ensure_ascii=False))
    write(out, t, "empty", json.dumps({"added_tokens_decoder": {}}))

    t = "pack_manifest"
    with open(manifest_path) as f:
        m = json.load(f)
    write(out, t, "tiny", json.dumps(m, separators=(",", ":")))
    small = dict(m)
    small["units"] = [u for u in m["units"] if u["unit"] in ("head", "layer.0")]
    write(out, t, "two_units", json.dumps(small, separators=(",", ":")))
    embed = dict(m)
    eu = dict(m["units"][0])
    eu["tensors"] = [dict(eu["tensors"][0], shape=[3, eu["tensors"][0]["shape"][1]])]
    eu["row_checksums"] = [1, 2, 3]
    embed["units"] = [eu]
    write(out, t, "embed_only", json.dumps(embed, separators=(",", ":")))
    write(out, t, "incomplete", json.dumps(dict(small, complete=False)))
    write(out, t, "empty_units", json.dumps(dict(m, units=[])))

    t = "routing_trace"
    write(out, t, "small", "# k3ring expert trace v1 layers=4 experts=8 top_k=2\n"
          "0 1 3 5\n0 2 1 0\n1 1 3 4\n1 2 7 6\n# comment\n\n2 1 5 3\n2 3 0 1\n")
    write(out, t, "top1", "# k3ring expert trace v1 layers=1 experts=2 top_k=1\n0 0 1\n1 0 0\n2 0 1\n")
    write(out, t, "header_only", "# k3ring expert trace v1 layers=93 experts=896 top_k=8\n")
    write(out, t, "wide", "# k3ring expert trace v1 layers=2 experts=16 top_k=4\n"
          + "".join(f"{tok} {l} {(tok + l) % 16} {(tok + 3) % 16} {(tok + 7 + l) % 16} {(tok * 5 + 11) % 16}\n"
                    for tok in range(12) for l in range(2)
                    if len({(tok + l) % 16, (tok + 3) % 16, (tok + 7 + l) % 16, (tok * 5 + 11) % 16}) == 4))
    write(out, t, "crlf", "# k3ring expert trace v1 layers=2 experts=4 top_k=2\r\n0 0 1 2\r\n0 1 3 0\r\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
