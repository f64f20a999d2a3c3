"""Seeded random weights for the tiny model, and their placement in shards.

Each tensor draws from its own generator, seeded by (seed, weight variant, crc32(name)), so a
tensor's values do not depend on the order tensors are made in. Scales are chosen to make the
tests sharp (see README.md "Weight scales"): sublayer outputs of order 1, SiTU caps reached,
peaky attention, and a routing bias large enough to reorder the top-k on most tokens.
"""

import math
import zlib

import numpy as np

from .dims import MLA_NOPE, MLA_ROPE, MLA_V, MXFP4_GROUP
from .numerics import bf16_bits
from .safetensors_io import StoredTensor

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"

# Linear layers draw N(0, (gain / sqrt(fan_in))^2), so with unit-RMS inputs an output has
# standard deviation about `gain`. Gains above 1 sharpen: SiTU gates past the cap of 4,
# confident router scores, peaky MLA attention.
GAIN = {
    "lm_head": 3.0,
    "res_proj": 1.0,          # attention-residual logits: std ~1 over candidates
    "kda_qkv": 1.0,
    "kda_f_a": 1.0,
    "kda_f_b": 1.5,
    "kda_b": 1.5,
    "kda_g": 1.5,
    "kda_o": 1.0,
    "mla_q_a": 1.0,
    "mla_q_b": 1.5,           # q and k of std ~1.5 and ~1.2: attention scores of std ~2
    "mla_kv_a": 1.2,
    "mla_kv_b": 1.2,
    "mla_g": 1.5,
    "mla_o": 1.0,
    "mlp_gate": 2.5,          # P(|a| > 4) ~ 10%
    "mlp_up": 1.5,
    "mlp_down": 0.5,
    "router": 1.5,
    "latent_down": 1.0,
    "latent_up": 1.0,
}
NORM_SPREAD = 0.25           # norm weights 1 + 0.25 N(0,1): not all ones, so "1 + w" shows
ROUTER_BIAS_STD = 0.2        # comparable to the score gaps near the top-k boundary
EMBED_STD = 1.0
# Target output std of the MXFP4 expert matrices for unit-RMS inputs (w2 sees SiTU outputs).
EXPERT_TARGET = {"w1": 3.0, "w3": 1.5, "w2": 0.35}
# RMS of a uniformly random E2M1 nibble times a scale drawn from {2^(e-1), 2^e, 2^(e+1)}.
E2M1_RMS = math.sqrt((0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8)
SCALE_SPREAD_RMS = math.sqrt((0.25 + 1 + 4) / 3)


class Draw:
    """Per-tensor seeded draws for one (seed, weight variant)."""

    def __init__(self, seed, variant):
        self.seed = seed
        self.variant = variant

    def rng(self, name):
        return np.random.default_rng([self.seed, self.variant, zlib.crc32(name.encode())])

    def bf16(self, name, shape, std, mean=0.0):
        values = mean + std * self.rng(name).standard_normal(shape)
        return StoredTensor(name, "BF16", bf16_bits(values))

    def f32(self, name, values):
        return StoredTensor(name, "F32", np.asarray(values, dtype=np.float32))

    def linear(self, name, n_out, n_in, gain):
        return self.bf16(name, (n_out, n_in), gain / math.sqrt(n_in))

    def norm(self, name, n):
        return self.bf16(name, (n,), NORM_SPREAD, mean=1.0)


# ---------------------------------------------------------------- per-block tensors

def common_tensors(draw, dims, p):
    d = dims.hidden
    return [
        draw.norm(p + "input_layernorm.weight", d),
        draw.norm(p + "self_attention_res_norm.weight", d),
        draw.linear(p + "self_attention_res_proj.weight", 1, d, GAIN["res_proj"]),
        draw.norm(p + "post_attention_layernorm.weight", d),
        draw.norm(p + "mlp_res_norm.weight", d),
        draw.linear(p + "mlp_res_proj.weight", 1, d, GAIN["res_proj"]),
    ]


def kda_tensors(draw, dims, p):
    d, w, k, h = dims.hidden, dims.kda_width, dims.kda_head_dim, dims.kda_heads
    p += "self_attn."
    out = [draw.linear(p + n + ".weight", w, d, GAIN["kda_qkv"])
           for n in ("q_proj", "k_proj", "v_proj")]
    for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
        # Four taps of std 0.6: the conv output has RMS ~1.2 and every tap matters.
        out.append(draw.f32(p + n + ".weight", 0.6 * draw.rng(p + n).standard_normal((w, 1, 4))))
    out += [
        draw.linear(p + "f_a_proj.weight", k, d, GAIN["kda_f_a"]),
        draw.linear(p + "f_b_proj.weight", w, k, GAIN["kda_f_b"]),
        draw.linear(p + "b_proj.weight", h, d, GAIN["kda_b"]),
        draw.f32(p + "A_log", a_log_values(draw.rng(p + "A_log"), dims)),
        # dt_bias centred below zero keeps many alphas near 1 (long memory), others decay fast.
        draw.f32(p + "dt_bias", -1.0 + draw.rng(p + "dt_bias").standard_normal(w)),
        draw.f32(p + "o_norm.weight",
                 1.0 + NORM_SPREAD * draw.rng(p + "o_norm").standard_normal(k)),
        draw.linear(p + "g_proj.weight", w, d, GAIN["kda_g"]),
        draw.linear(p + "o_proj.weight", d, w, GAIN["kda_o"]),
    ]
    return out


def a_log_values(rng, dims):
    """A_log [max(head_dim, heads)]: one value per head, |A_log| in [0.6, 1.6] so that using
    it per channel (a trap) changes the decay; the entries past `heads` are zero."""
    values = np.zeros(dims.a_log_len)
    signs = rng.choice([-1.0, 1.0], size=dims.kda_heads)
    values[:dims.kda_heads] = signs * rng.uniform(0.6, 1.6, size=dims.kda_heads)
    return values


def mla_tensors(draw, dims, p):
    d, n = dims.hidden, dims.mla_heads
    p += "self_attn."
    return [
        draw.linear(p + "q_a_proj.weight", dims.q_lora_rank, d, GAIN["mla_q_a"]),
        draw.norm(p + "q_a_layernorm.weight", dims.q_lora_rank),
        draw.linear(p + "q_b_proj.weight", n * (MLA_NOPE + MLA_ROPE), dims.q_lora_rank,
                    GAIN["mla_q_b"]),
        draw.linear(p + "kv_a_proj_with_mqa.weight", dims.kv_lora_rank + MLA_ROPE, d,
                    GAIN["mla_kv_a"]),
        draw.norm(p + "kv_a_layernorm.weight", dims.kv_lora_rank),
        draw.linear(p + "kv_b_proj.weight", n * (MLA_NOPE + MLA_V), dims.kv_lora_rank,
                    GAIN["mla_kv_b"]),
        draw.linear(p + "g_proj.weight", n * MLA_V, d, GAIN["mla_g"]),
        draw.linear(p + "o_proj.weight", d, n * MLA_V, GAIN["mla_o"]),
    ]


def glu_tensors(draw, p, d, width):
    return [
        draw.linear(p + "gate_proj.weight", width, d, GAIN["mlp_gate"]),
        draw.linear(p + "up_proj.weight", width, d, GAIN["mlp_up"]),
        draw.linear(p + "down_proj.weight", d, width, GAIN["mlp_down"]),
    ]


def moe_trunk_tensors(draw, dims, p):
    d, lat = dims.hidden, dims.latent
    p += "block_sparse_moe."
    bias = ROUTER_BIAS_STD * draw.rng(p + "bias").standard_normal(dims.n_experts)
    return [
        draw.linear(p + "gate.weight", dims.n_experts, d, GAIN["router"]),
        draw.f32(p + "gate.e_score_correction_bias", bias),
        draw.linear(p + "routed_expert_down_proj.weight", lat, d, GAIN["latent_down"]),
        draw.norm(p + "routed_expert_norm.weight", lat),
        draw.linear(p + "routed_expert_up_proj.weight", d, lat, GAIN["latent_up"]),
    ] + glu_tensors(draw, p + "shared_experts.", d, dims.shared_inter)


def mxfp4_pair(draw, name, n_out, n_in, target_std):
    """weight_packed [n_out, n_in/2] (random nibbles) and weight_scale [n_out, n_in/32]."""
    assert n_in % MXFP4_GROUP == 0
    base = round(math.log2(target_std / (E2M1_RMS * SCALE_SPREAD_RMS * math.sqrt(n_in))))
    packed = draw.rng(name + ".weight_packed").integers(0, 256, size=(n_out, n_in // 2))
    spread = draw.rng(name + ".weight_scale").integers(-1, 2, size=(n_out, n_in // MXFP4_GROUP))
    scale = 127 + base + spread
    assert scale.min() > 0 and scale.max() < 0xFF
    return [StoredTensor(name + ".weight_packed", "U8", packed),
            StoredTensor(name + ".weight_scale", "U8", scale)]


def expert_tensors(draw, dims, p, e):
    """The six tensors of one expert, in the normal order w1, w3, w2 (packed then scale)."""
    f, lat = dims.moe_inter, dims.latent
    q = "%sblock_sparse_moe.experts.%d." % (p, e)
    return (mxfp4_pair(draw, q + "w1", f, lat, EXPERT_TARGET["w1"])
            + mxfp4_pair(draw, q + "w3", f, lat, EXPERT_TARGET["w3"])
            + mxfp4_pair(draw, q + "w2", lat, f, EXPERT_TARGET["w2"]))


def experts_in_storage_order(draw, dims, p, layer, split_expert_slot):
    """All experts of a layer in a seeded, non-id order. If split_expert_slot is not None, the
    expert stored at that slot has its w2 tensors moved after the next expert's tensors.
    Returns (tensors, id of the split expert or None)."""
    order = draw.rng("expert_order.%d" % layer).permutation(dims.n_experts).tolist()
    blocks = [expert_tensors(draw, dims, p, e) for e in order]
    split_id = None
    if split_expert_slot is not None:
        j = split_expert_slot
        w2 = blocks[j][4:]
        blocks[j] = blocks[j][:4]
        blocks[j + 1] = blocks[j + 1] + w2
        split_id = order[j]
    return [t for block in blocks for t in block], split_id


# ---------------------------------------------------------------- assembly

def layer_tensors(draw, dims, layer, split_layers):
    p = "%slayers.%d." % (PREFIX, layer)
    out = common_tensors(draw, dims, p)
    out += mla_tensors(draw, dims, p) if dims.is_mla(layer) else kda_tensors(draw, dims, p)
    if not dims.is_moe(layer):
        return out + glu_tensors(draw, p + "mlp.", dims.hidden, dims.dense_inter), None
    out += moe_trunk_tensors(draw, dims, p)
    slot = None
    if layer in split_layers:
        slot = int(draw.rng("split_slot.%d" % layer).integers(0, dims.n_experts - 1))
    experts, split_id = experts_in_storage_order(draw, dims, p, layer, slot)
    return out + experts, split_id


def head_tensors(draw, dims):
    d = dims.hidden
    return [
        draw.norm(PREFIX + "output_attn_res_norm.weight", d),
        draw.linear(PREFIX + "output_attn_res_proj.weight", 1, d, GAIN["res_proj"]),
        draw.norm(PREFIX + "norm.weight", d),
        draw.linear(LM_HEAD, dims.vocab, d, GAIN["lm_head"]),
    ]


def make_shards(dims, variant):
    """All tensors, placed in shards. Returns (shards, noncontiguous_experts) where shards is a
    list of tensor lists in data order.

    Layers go to shards in contiguous runs (np.array_split), each layer's tensors contiguous in
    one shard; the embedding opens the first shard and the head closes the last. The first and
    last MoE layers each get one expert whose w2 tensors are stored after another expert's.
    """
    draw = Draw(dims.seed, variant)
    split_layers = sorted({1, dims.n_layers - 1})
    shards = []
    noncontiguous = []
    for shard_index, layers in enumerate(np.array_split(np.arange(dims.n_layers), dims.n_shards)):
        tensors = []
        if shard_index == 0:
            tensors.append(draw.bf16(PREFIX + "embed_tokens.weight", (dims.vocab, dims.hidden),
                                     EMBED_STD))
        for layer in layers.tolist():
            layer_list, split_id = layer_tensors(draw, dims, layer, split_layers)
            tensors += layer_list
            if split_id is not None:
                noncontiguous.append([layer, split_id])
        if shard_index == dims.n_shards - 1:
            tensors += head_tensors(draw, dims)
        shards.append(tensors)
    return shards, noncontiguous


def shard_file_name(index, count):
    return "model-%05d-of-%05d.safetensors" % (index + 1, count)
