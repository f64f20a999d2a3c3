"""Writing the checkpoint files, reading them back, and turning stored tensors into the float64
arrays the reference computes with (bf16 and MXFP4 decoded exactly)."""

import copy
import glob
import json
import os

import numpy as np

from .numerics import bf16_to_f64, f32_to_f64, mxfp4_decode
from .safetensors_io import read_safetensors, write_safetensors
from .weights import LM_HEAD, PREFIX, shard_file_name

INDEX_NAME = "model.safetensors.index.json"


def dump_json(path, obj):
    """Deterministic JSON: sorted keys, 2-space indent, UTF-8, trailing newline."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n")


def write_text(path, text):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def remove_stale_shards(out_dir):
    """A previous run with another --shards leaves other model-*-of-*.safetensors behind."""
    for path in sorted(glob.glob(os.path.join(out_dir, "model-*-of-*.safetensors"))):
        os.remove(path)


def write_shards(out_dir, shards):
    """Write the shards and the index; return the index dict."""
    remove_stale_shards(out_dir)
    weight_map = {}
    total = 0
    for index, tensors in enumerate(shards):
        name = shard_file_name(index, len(shards))
        total += write_safetensors(os.path.join(out_dir, name), tensors)
        for t in tensors:
            assert t.name not in weight_map, t.name
            weight_map[t.name] = name
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    dump_json(os.path.join(out_dir, INDEX_NAME), index)
    return index


def read_checkpoint(out_dir):
    """Read every tensor back through the index: {name: StoredTensor}."""
    with open(os.path.join(out_dir, INDEX_NAME), encoding="utf-8") as f:
        index = json.load(f)
    stored = {}
    for shard in sorted(set(index["weight_map"].values())):
        for name, tensor in read_safetensors(os.path.join(out_dir, shard)).items():
            assert index["weight_map"].get(name) == shard, (name, shard)
            stored[name] = tensor
    assert set(stored) == set(index["weight_map"]), "index and shards disagree"
    assert sum(t.nbytes for t in stored.values()) == index["metadata"]["total_size"]
    return stored


# ---------------------------------------------------------------- float64 model

def to_f64(tensor):
    if tensor.dtype == "BF16":
        return bf16_to_f64(tensor.array)
    if tensor.dtype == "F32":
        return f32_to_f64(tensor.array)
    raise ValueError("no float view of %s (%s)" % (tensor.name, tensor.dtype))


class Model:
    """Float64 weights. `layers[l]` maps checkpoint suffixes (e.g. "self_attn.q_proj.weight")
    to arrays; `experts[l][e]` is (w1, w3, w2) decoded from MXFP4; the head keeps its own names.
    """

    def __init__(self, dims, stored, nibble_swap=False):
        self.dims = dims
        g = lambda suffix: to_f64(stored[PREFIX + suffix])
        self.embed = g("embed_tokens.weight")
        self.norm = g("norm.weight")
        self.out_res_norm = g("output_attn_res_norm.weight")
        self.out_res_proj = g("output_attn_res_proj.weight")[0]
        self.lm_head = to_f64(stored[LM_HEAD])
        self.layers = []
        self.experts = []
        for layer in range(dims.n_layers):
            p = "%slayers.%d." % (PREFIX, layer)
            arrays = {name[len(p):]: to_f64(t) for name, t in stored.items()
                      if name.startswith(p) and t.dtype != "U8"}
            self.layers.append(arrays)
            self.experts.append(decode_experts(stored, p, dims, nibble_swap) if dims.is_moe(layer)
                                else None)

    def cast(self, dtype):
        """A copy with every array in `dtype` (float32 for the engine-rounding estimate)."""
        other = copy.copy(self)
        for name in ("embed", "norm", "out_res_norm", "out_res_proj", "lm_head"):
            setattr(other, name, getattr(self, name).astype(dtype))
        other.layers = [{k: v.astype(dtype) for k, v in arrays.items()} for arrays in self.layers]
        other.experts = [None if mats is None else [tuple(m.astype(dtype) for m in e) for e in mats]
                         for mats in self.experts]
        return other


def decode_experts(stored, p, dims, nibble_swap):
    experts = []
    for e in range(dims.n_experts):
        q = "%sblock_sparse_moe.experts.%d." % (p, e)
        mats = tuple(mxfp4_decode(stored[q + w + ".weight_packed"].array,
                                  stored[q + w + ".weight_scale"].array, nibble_swap)
                     for w in ("w1", "w3", "w2"))
        assert mats[0].shape == (dims.moe_inter, dims.latent)
        assert mats[2].shape == (dims.latent, dims.moe_inter)
        experts.append(mats)
    return experts


def stored_equal(a, b):
    """True when two {name: StoredTensor} maps hold the same dtypes, shapes and bytes."""
    if set(a) != set(b):
        return False
    return all(a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
               and np.array_equal(a[n].array, b[n].array) for n in a)
