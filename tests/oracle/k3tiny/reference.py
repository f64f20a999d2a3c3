"""The float64 forward pass of spec section 5, written from the spec alone.

`forward(model, state, ids)` runs a chunk of tokens: the first call on a fresh state is a
prefill, later calls with one token are decode steps. Only the attention states (KDA recurrent
state and conv history, MLA latent cache) carry across calls; the residual stream is per token.

Each known implementation bug ("trap", spec section 5 end) is an explicit flag in `Traps`, all
off by default, so that the tool can show that every trap changes the model's output.
"""

from dataclasses import dataclass, fields

import numpy as np

from .dims import MLA_NOPE, MLA_ROPE, MLA_V
from .numerics import l2_norm, rms_norm, sigmoid, silu, situ_glu, softmax

EPS = 1e-5                 # every RMSNorm, the attention-residual norm and o_norm
MLA_LATENT_EPS = 1e-6      # q_a_layernorm and kv_a_layernorm (release code)
GATE_LOWER_BOUND = -5.0
ROUTED_SCALING_FACTOR = 1.0
RENORM_EPS = 1e-20
CONV_WIDTH = 4


@dataclass(frozen=True)
class Traps:
    """One flag per known bug; the reference is correct with all flags off."""
    nibble_swap: bool = False              # MXFP4 high nibble read first (applied when decoding)
    bias_in_weights: bool = False          # routing bias added into the expert weights
    alog_per_channel: bool = False         # A_log indexed by channel-within-head, not by head
    latent_norm_per_expert: bool = False   # routed_expert_norm on each expert, not the aggregate
    v_l2norm: bool = False                 # KDA v l2-normalised like q and k
    mla_scale_128: bool = False            # MLA scores scaled by nope^-0.5 instead of (nope+rope)
    shared_on_latent: bool = False         # shared experts applied to the latent u, not to x
    no_partial_restart: bool = False       # partial sum not restarted at block starts l > 0
    embedding_in_partial: bool = False     # embedding kept in the partial sum at layer 0
    kda_read_before_decay: bool = False    # KDA output read from the state before this token


NO_TRAPS = Traps()
TRAP_NAMES = tuple(f.name for f in fields(Traps))


# ---------------------------------------------------------------- state and trace

class KdaState:
    def __init__(self, dims, dtype=np.float64):
        width, tail = dims.kda_width, CONV_WIDTH - 1
        self.conv = {key: np.zeros((tail, width), dtype) for key in ("q", "k", "v")}
        k = dims.kda_head_dim
        self.S = np.zeros((dims.kda_heads, k, k), dtype)   # [heads, K, V] per head


class MlaState:
    def __init__(self, dims, dtype=np.float64):
        self.ckv = np.zeros((0, dims.kv_lora_rank), dtype)  # normalised c_kv per position
        self.kr = np.zeros((0, MLA_ROPE), dtype)            # shared k_r per position


def new_state(dims, dtype=np.float64):
    """Fresh attention states; dtype float32 only for the f32 rounding estimate."""
    return [MlaState(dims, dtype) if dims.is_mla(l) else KdaState(dims, dtype)
            for l in range(dims.n_layers)]


class Trace:
    """Optional recorder: per-layer intermediates, and the raw material of the statistics."""

    def __init__(self, n_layers):
        self.layers = [{} for _ in range(n_layers)]
        self.glu_inputs = {"dense": [], "shared": [], "experts": []}   # (a, b) pairs
        self.routing = []           # one dict per (MoE layer, token)
        self.snapshots = None
        self.final_hidden = None


# ---------------------------------------------------------------- the model

def forward(model, state, ids, traps=NO_TRAPS, trace=None):
    """Logits [n, V] for the tokens `ids`, continuing from `state` (updated in place)."""
    dims = model.dims
    p = model.embed[np.asarray(ids, dtype=np.int64)]
    snapshots = []
    for layer in range(dims.n_layers):
        p, snapshots = decoder_layer(model, state[layer], layer, p, snapshots, traps, trace)
    h = attn_res_read(snapshots + [p], model.out_res_norm, model.out_res_proj)
    if trace is not None:
        trace.snapshots = np.stack(snapshots)
        trace.final_hidden = h
    return rms_norm(h, model.norm, EPS) @ model.lm_head.T


def attn_res_read(candidates, norm_weight, proj_weight):
    """R(p, B): softmax over candidates of sum_d rmsnorm(v)[d] g[d] w[d], mixing RAW values."""
    values = np.stack(candidates)                                   # [J, n, D]
    normed = values / np.sqrt(np.mean(values * values, axis=-1, keepdims=True) + EPS)
    logits = np.sum(normed * (norm_weight * proj_weight), axis=-1)  # [J, n]
    weights = softmax(logits, axis=0)
    return np.sum(weights[..., None] * values, axis=0)


def decoder_layer(model, st, layer, p_in, snapshots, traps, trace):
    dims, lw = model.dims, model.layers[layer]
    if snapshots:
        x = attn_res_read(snapshots + [p_in], lw["self_attention_res_norm.weight"],
                          lw["self_attention_res_proj.weight"][0])
    else:
        x = p_in  # layer 0 only: the embedding itself
    p = p_in
    if layer % dims.attn_res_block == 0:
        snapshots = snapshots + [p_in]
        p = restarted_partial(p_in, layer, traps)
    normed = rms_norm(x, lw["input_layernorm.weight"], EPS)
    a = mla(lw, st, normed, traps) if dims.is_mla(layer) else kda(lw, st, normed, dims, traps)
    p = p + a
    y = attn_res_read(snapshots + [p], lw["mlp_res_norm.weight"], lw["mlp_res_proj.weight"][0])
    normed = rms_norm(y, lw["post_attention_layernorm.weight"], EPS)
    record = trace.layers[layer] if trace is not None else None
    if dims.is_moe(layer):
        m = moe(lw, model.experts[layer], normed, dims, traps, trace, record)
    else:
        m = glu(lw, "mlp.", normed, trace, "dense")
    p = p + m
    if record is not None:
        record.update(attn_input=x, attn_out=a, mlp_input=y, ffn_out=m, partial=p)
    return p, snapshots


def restarted_partial(p_in, layer, traps):
    """At a block start the partial sum restarts from zero (the embedding is snapshot 0 and is
    never part of p). The two traps keep p_in instead, at layer 0 or at later block starts."""
    keep = traps.embedding_in_partial if layer == 0 else traps.no_partial_restart
    return p_in if keep else np.zeros_like(p_in)


def glu(lw, prefix, x, trace, kind):
    """down(SiTU-GLU(gate x, up x)): the dense MLP of layer 0 and the shared experts."""
    a = x @ lw[prefix + "gate_proj.weight"].T
    b = x @ lw[prefix + "up_proj.weight"].T
    if trace is not None:
        trace.glu_inputs[kind].append((a, b))
    return situ_glu(a, b) @ lw[prefix + "down_proj.weight"].T


# ---------------------------------------------------------------- KDA

def kda(lw, st, x, dims, traps):
    """Kimi Delta Attention over the chunk x [n, D] (already normalised)."""
    n, heads, k = x.shape[0], dims.kda_heads, dims.kda_head_dim
    w = lambda name: lw["self_attn." + name]
    q = short_conv(st, "q", x @ w("q_proj.weight").T, w("q_conv1d.weight"))
    kk = short_conv(st, "k", x @ w("k_proj.weight").T, w("k_conv1d.weight"))
    v = short_conv(st, "v", x @ w("v_proj.weight").T, w("v_conv1d.weight"))
    q = l2_norm(q.reshape(n, heads, k)) * k ** -0.5
    kk = l2_norm(kk.reshape(n, heads, k))
    v = v.reshape(n, heads, k)
    if traps.v_l2norm:
        v = l2_norm(v)
    alpha = kda_decay(lw, x, dims, traps)                          # [n, heads, K]
    beta = sigmoid(x @ w("b_proj.weight").T)                       # [n, heads]
    o = delta_rule(st, q, kk, v, alpha, beta, traps.kda_read_before_decay)
    o = rms_norm(o, w("o_norm.weight"), EPS)                       # per head over K
    o = o.reshape(n, heads * k) * sigmoid(x @ w("g_proj.weight").T)
    return o @ w("o_proj.weight").T


def short_conv(st, key, u, weight):
    """Depthwise causal conv (width W, no bias) then SiLU; tap W-1 is the current token and the
    last W-1 inputs are carried in st.conv[key] across calls."""
    n, taps = u.shape[0], weight.shape[2]
    history = np.concatenate([st.conv[key], u])                    # [W-1+n, C]
    out = sum(weight[:, 0, i] * history[i:i + n] for i in range(taps))
    st.conv[key] = history[n:]
    return silu(out)


def kda_decay(lw, x, dims, traps):
    """alpha = exp(g), g = lower_bound * sigmoid(exp(A_log[head]) * (f_b(f_a x) + dt_bias))."""
    heads, k = dims.kda_heads, dims.kda_head_dim
    z = (x @ lw["self_attn.f_a_proj.weight"].T) @ lw["self_attn.f_b_proj.weight"].T
    a_log = lw["self_attn.A_log"]
    if traps.alog_per_channel:
        per_channel = np.tile(a_log[:k], heads)
    else:
        per_channel = np.repeat(a_log[:heads], k)
    g = GATE_LOWER_BOUND * sigmoid(np.exp(per_channel) * (z + lw["self_attn.dt_bias"]))
    return np.exp(g).reshape(x.shape[0], heads, k)


def delta_rule(st, q, k, v, alpha, beta, read_before_decay):
    """Per token: S <- diag(alpha) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q."""
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        previous = st.S
        s = alpha[t][:, :, None] * previous
        u = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * u[:, None, :]
        read = previous if read_before_decay else s
        out[t] = np.einsum("hkv,hk->hv", read, q[t])
        st.S = s
    return out


# ---------------------------------------------------------------- MLA

def mla(lw, st, x, traps):
    """Gated MLA without positions: latent q and kv, shared k_r, causal softmax, output gate."""
    n = x.shape[0]
    w = lambda name: lw["self_attn." + name]
    heads = w("g_proj.weight").shape[0] // MLA_V
    cq = rms_norm(x @ w("q_a_proj.weight").T, w("q_a_layernorm.weight"), MLA_LATENT_EPS)
    q = (cq @ w("q_b_proj.weight").T).reshape(n, heads, MLA_NOPE + MLA_ROPE)
    c = x @ w("kv_a_proj_with_mqa.weight").T
    lora = st.ckv.shape[1]
    st.ckv = np.concatenate([st.ckv, rms_norm(c[:, :lora], w("kv_a_layernorm.weight"),
                                              MLA_LATENT_EPS)])
    st.kr = np.concatenate([st.kr, c[:, lora:]])                   # not normalised
    kv = (st.ckv @ w("kv_b_proj.weight").T).reshape(-1, heads, MLA_NOPE + MLA_V)
    scores = (np.einsum("thd,shd->hts", q[..., :MLA_NOPE], kv[..., :MLA_NOPE])
              + np.einsum("thd,sd->hts", q[..., MLA_NOPE:], st.kr))
    scale = MLA_NOPE ** -0.5 if traps.mla_scale_128 else (MLA_NOPE + MLA_ROPE) ** -0.5
    probs = softmax(np.where(causal_mask(n, st.ckv.shape[0]), scores * scale, -np.inf))
    o = np.einsum("hts,shv->thv", probs, kv[..., MLA_NOPE:]).reshape(n, heads * MLA_V)
    o = o * sigmoid(x @ w("g_proj.weight").T)
    return o @ w("o_proj.weight").T


def causal_mask(n, total):
    """[n, total]: chunk token t (absolute position total-n+t) sees positions <= its own."""
    positions = total - n + np.arange(n)
    return np.arange(total)[None, :] <= positions[:, None]


# ---------------------------------------------------------------- LatentMoE

def moe(lw, experts, x, dims, traps, trace, record):
    """Stable LatentMoE: sigmoid router, biased top-k selection, unbiased renormalised weights,
    experts in the latent space, RMSNorm of the aggregate, up projection, plus shared experts."""
    pre = "block_sparse_moe."
    scores = sigmoid(x @ lw[pre + "gate.weight"].T)                   # [n, E]
    biased = scores + lw[pre + "gate.e_score_correction_bias"]
    ranked = np.stack([top_k(row, dims.top_k + 1) for row in biased])  # [n, k+1]
    indices = ranked[:, :dims.top_k]                                   # the fixed top-k order
    chosen = np.take_along_axis(biased if traps.bias_in_weights else scores, indices, axis=1)
    weights = chosen / (np.sum(chosen, axis=1, keepdims=True) + RENORM_EPS) * ROUTED_SCALING_FACTOR
    u = x @ lw[pre + "routed_expert_down_proj.weight"].T               # [n, LAT]
    outs = expert_outputs(experts, u, indices, trace)                  # [n, k, LAT]
    norm_weight = lw[pre + "routed_expert_norm.weight"]
    if traps.latent_norm_per_expert:
        outs = rms_norm(outs, norm_weight, EPS)
    y = sum(weights[:, i, None] * outs[:, i] for i in range(dims.top_k))  # top-k order
    if not traps.latent_norm_per_expert:
        y = rms_norm(y, norm_weight, EPS)
    routed = y @ lw[pre + "routed_expert_up_proj.weight"].T
    shared = glu(lw, pre + "shared_experts.", u if traps.shared_on_latent else x, trace, "shared")
    if trace is not None:
        trace.routing += [routing_record(s, b, dims.top_k) for s, b in zip(scores, biased)]
    if record is not None:
        record.update(router_indices=indices, router_weights=weights,
                      router_biased_topk1=np.take_along_axis(biased, ranked, axis=1))
    return routed + shared


def top_k(biased, k):
    """Indices of the k largest biased scores, in descending order, ties to the lower index."""
    order = np.lexsort((np.arange(biased.shape[0]), -biased))
    return order[:k]


def expert_outputs(experts, u, indices, trace):
    """E_e(u_t) = w2 SiTU-GLU(w1 u_t, w3 u_t) for every (token t, slot i): [n, k, LAT].
    Tokens are batched per expert; each output lands in its own (t, i) slot."""
    outs = np.zeros(indices.shape + u.shape[1:], dtype=u.dtype)
    for e in np.unique(indices).tolist():
        tokens, slots = np.nonzero(indices == e)
        w1, w3, w2 = experts[e]
        a, b = u[tokens] @ w1.T, u[tokens] @ w3.T
        if trace is not None:
            trace.glu_inputs["experts"].append((a, b))
        outs[tokens, slots] = situ_glu(a, b) @ w2.T
    return outs


def routing_record(scores, biased, k):
    """What the statistics need about one routing decision."""
    by_biased = top_k(biased, k + 1)
    by_score = top_k(scores, k)
    sorted_biased = biased[by_biased]
    return {
        "set_differs": set(by_biased[:k].tolist()) != set(by_score.tolist()),
        "order_differs": by_biased[:k].tolist() != by_score.tolist(),
        "boundary_gap": float(sorted_biased[k - 1] - sorted_biased[k]),
        "order_gap": float(np.min(sorted_biased[:k - 1] - sorted_biased[1:k])),
    }
