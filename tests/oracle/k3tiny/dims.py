"""Sizes of the tiny K3 model, derived from the command line, and its config.json.

The widths follow one rule so that any --hidden gives a consistent model (see README.md):
MXFP4 widths (F, LAT) stay multiples of the group size 32, the KDA width (heads * 16) differs
from D, and every layer kind (dense, KDA, MLA, MoE) and attention-residual case (several block
boundaries, a partial last block) is present.
"""

from dataclasses import dataclass

MXFP4_GROUP = 32
ADDED_TOKENS = 256
N_GREEDY = 24

# Fixed head sizes: small enough to be cheap, different from each other so that a mixed-up
# dimension fails loudly instead of silently reading the wrong slice.
KDA_HEAD_DIM = 16
MLA_NOPE = 16
MLA_ROPE = 8
MLA_V = 16


@dataclass(frozen=True)
class Dims:
    seed: int
    n_layers: int
    hidden: int
    n_experts: int
    top_k: int
    attn_res_block: int
    vocab: int
    n_shards: int

    # ---- derived widths (rule documented in README.md) ----
    @property
    def n_ranks(self):
        return self.vocab - ADDED_TOKENS

    @property
    def kda_heads(self):
        return max(2, (3 * self.hidden) // 64)

    @property
    def kda_head_dim(self):
        return KDA_HEAD_DIM

    @property
    def kda_width(self):
        return self.kda_heads * self.kda_head_dim

    @property
    def a_log_len(self):
        # The release stores A_log as [128] for 96 heads: max(head_dim, heads) entries.
        return max(self.kda_head_dim, self.kda_heads)

    @property
    def mla_heads(self):
        return max(2, self.hidden // 16)

    @property
    def q_lora_rank(self):
        return self.hidden // 2

    @property
    def kv_lora_rank(self):
        return self.hidden // 2

    @property
    def dense_inter(self):
        return (3 * self.hidden) // 2

    @property
    def moe_inter(self):
        """F: expert hidden width (MXFP4, so a multiple of 32)."""
        return MXFP4_GROUP * max(1, self.hidden // 64)

    @property
    def latent(self):
        """LAT: routed-expert latent width (MXFP4, so a multiple of 32)."""
        return 2 * MXFP4_GROUP * max(1, self.hidden // 64)

    @property
    def shared_inter(self):
        return 2 * self.moe_inter

    # ---- layer kinds ----
    @property
    def full_attn_layers(self):
        """1-based MLA layers: every 4th, plus the last two (K3 ends with two MLA layers)."""
        layers = set(range(4, self.n_layers + 1, 4))
        layers.update({self.n_layers - 1, self.n_layers})
        return sorted(layers)

    @property
    def kda_layers(self):
        full = set(self.full_attn_layers)
        return [i for i in range(1, self.n_layers + 1) if i not in full]

    def is_mla(self, layer):
        return (layer + 1) in self.full_attn_layers

    def is_moe(self, layer):
        return layer >= 1  # first_k_dense_replace 1, moe_layer_freq 1

    @property
    def block_starts(self):
        return list(range(0, self.n_layers, self.attn_res_block))

    @property
    def n_snapshots(self):
        return len(self.block_starts)

    def validate(self):
        """Raise ValueError naming every problem at once."""
        problems = []
        if self.n_layers < 4:
            problems.append("--layers must be >= 4 (dense layer 0, KDA layers, two MLA layers)")
        if self.hidden < 32 or self.hidden % 16:
            problems.append("--hidden must be a multiple of 16 and >= 32")
        if not 2 <= self.top_k < self.n_experts:
            problems.append("--topk must be >= 2 and < --experts")
        if not 2 <= self.attn_res_block < self.n_layers:
            problems.append("--attn-res-block must be >= 2 and < --layers")
        if self.n_ranks < 256 + 64:
            problems.append("--vocab must be >= 576 (256 byte ranks + 64 merges + 256 added)")
        if not 1 <= self.n_shards <= self.n_layers:
            problems.append("--shards must be between 1 and --layers")
        if self.moe_inter % MXFP4_GROUP or self.latent % MXFP4_GROUP:
            problems.append("MXFP4 widths F and LAT must be multiples of 32")
        if problems:
            raise ValueError("; ".join(problems))

    def summary(self):
        """Everything a test may want to know about the shapes, for reference.json."""
        return {
            "seed": self.seed,
            "n_layers": self.n_layers,
            "hidden": self.hidden,
            "vocab_size": self.vocab,
            "n_ranks": self.n_ranks,
            "n_added_tokens": ADDED_TOKENS,
            "n_shards": self.n_shards,
            "kda_heads": self.kda_heads,
            "kda_head_dim": self.kda_head_dim,
            "a_log_len": self.a_log_len,
            "mla_heads": self.mla_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": MLA_NOPE,
            "qk_rope_head_dim": MLA_ROPE,
            "v_head_dim": MLA_V,
            "dense_intermediate": self.dense_inter,
            "moe_intermediate": self.moe_inter,
            "latent": self.latent,
            "shared_intermediate": self.shared_inter,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "attn_res_block_size": self.attn_res_block,
            "block_starts": self.block_starts,
            "n_snapshots": self.n_snapshots,
            "full_attn_layers_1based": self.full_attn_layers,
            "kda_layers_1based": self.kda_layers,
            "mla_layers": [i for i in range(self.n_layers) if self.is_mla(i)],
            "moe_layers": [i for i in range(self.n_layers) if self.is_moe(i)],
            "n_greedy": N_GREEDY,
        }


def special_token_names(n_ranks):
    """Added tokens R..R+255, named as in K3 (reserved ones carry their absolute id)."""
    named = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]
    names = {}
    for offset in range(ADDED_TOKENS):
        token_id = n_ranks + offset
        if offset < len(named):
            names[token_id] = named[offset]
        else:
            names[token_id] = "<|reserved_token_%d|>" % token_id
    return names


def token_ids(dims):
    r = dims.n_ranks
    return {"bos": r, "eos": r + 2, "pad": r + ADDED_TOKENS - 1}


def quantization_config():
    # The ignore list deliberately leaves out the router and the latent projections (which are
    # BF16 all the same), as in the release: engines must decide per tensor by weight_packed.
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": MXFP4_GROUP,
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "uint8",
                },
            }
        },
        "ignore": [
            "language_model.lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|down)_proj.*",
        ],
    }


def config_json(dims):
    """The nested config.json of the release, with tiny values."""
    ids = token_ids(dims)
    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "torch_dtype": "bfloat16",
        "vocab_size": dims.vocab,
        "hidden_size": dims.hidden,
        "num_hidden_layers": dims.n_layers,
        "intermediate_size": dims.dense_inter,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "num_attention_heads": dims.mla_heads,
        "q_lora_rank": dims.q_lora_rank,
        "kv_lora_rank": dims.kv_lora_rank,
        "qk_nope_head_dim": MLA_NOPE,
        "qk_rope_head_dim": MLA_ROPE,
        "v_head_dim": MLA_V,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": dims.n_experts,
        "num_experts_per_token": dims.top_k,
        "num_shared_experts": 2,
        "moe_intermediate_size": dims.moe_inter,
        "routed_expert_hidden_size": dims.latent,
        "latent_moe_use_norm": True,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "attn_res_block_size": dims.attn_res_block,
        "tie_word_embeddings": False,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "linear_attn_config": {
            "num_heads": dims.kda_heads,
            "head_dim": dims.kda_head_dim,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            "full_attn_layers": dims.full_attn_layers,
            "kda_layers": dims.kda_layers,
        },
        "quantization_config": quantization_config(),
    }
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {},
    }
