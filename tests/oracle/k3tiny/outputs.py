"""The reference outputs: reference.json, reference.safetensors and tokenizer_cases.json."""

import os

import numpy as np

from .checkpoint import dump_json
from .corpus import TOKENIZER_CASES
from .safetensors_io import StoredTensor, write_safetensors
from .tokenizer import K3_PATTERN, package_encode, package_encoding

FORMAT_VERSION = 1
TOKENIZER_CASES_NAME = "tokenizer_cases.json"
# Per-layer prompt intermediates, in the order they are stored.
LAYER_KEYS = ("attn_input", "attn_out", "mlp_input", "ffn_out", "partial")


def reference_json(dims, run, prompt_text, token_ids, noncontiguous, args):
    ev = run["evaluation"]
    return {
        "format_version": FORMAT_VERSION,
        "generator": {
            "args": args,
            "weight_variant": run["weight_variant"],
            "prompt_variant": run["prompt_variant"],
            "rejected_variants": run["rejected"],
        },
        "dims": dims.summary(),
        "token_ids": token_ids,
        "prompt_text": prompt_text,
        "prompt_starts_with_bos": True,
        "prompt_ids": ev.prompt_ids,
        "teacher_forced_argmax": ev.teacher_forced_argmax,
        "teacher_forced_min_margin": ev.stats["teacher_forced_min_margin"],
        "greedy_ids": ev.greedy_ids,
        "greedy_min_margin": ev.stats["greedy_min_margin"],
        "stats": ev.stats,
        "noncontiguous_experts": noncontiguous,
        "traps": ev.traps,
    }


def f32(name, array):
    return StoredTensor(name, "F32", np.asarray(array, dtype=np.float32))


def i32(name, array):
    values = np.asarray(array, dtype=np.int64)
    assert values.min() >= 0 and values.max() < 2 ** 31
    return StoredTensor(name, "I32", values.astype(np.int32))


def reference_tensors(dims, ev):
    """Prompt logits and intermediates, greedy-path logits; F32 except ids/indices (I32)."""
    trace = ev.prompt_trace
    tensors = [
        i32("prompt_ids", ev.prompt_ids),
        i32("greedy_ids", ev.greedy_ids),
        f32("logits_last", ev.prompt_logits[-1]),
        f32("logits_prompt", ev.prompt_logits),
        f32("logits_greedy", ev.greedy_logits),
        f32("snapshots", trace.snapshots),
        f32("final_hidden", trace.final_hidden),
    ]
    for layer, record in enumerate(trace.layers):
        p = "layers.%d." % layer
        tensors += [f32(p + key, record[key]) for key in LAYER_KEYS]
        if dims.is_moe(layer):
            tensors += [i32(p + "router_indices", record["router_indices"]),
                        f32(p + "router_weights", record["router_weights"]),
                        f32(p + "router_biased_topk1", record["router_biased_topk1"])]
    return tensors


def write_reference(out_dir, reference, tensors):
    dump_json(os.path.join(out_dir, "reference.json"), reference)
    write_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors)


def tokenizer_cases(tokenizer, n_ranks, prompt_text):
    """Cases with ids from the Python tiktoken package, cross-checked against the pure-Python
    encoder and the decode round trip. Returns None when tiktoken is not installed."""
    encoding = package_encoding(tokenizer.ranks, tokenizer.specials)
    if encoding is None:
        return None
    texts = [(text.replace("%d", str(n_ranks + 10)), allow) for text, allow in TOKENIZER_CASES]
    texts.append((prompt_text, False))
    cases = []
    for text, allow in texts:
        ids = package_encode(encoding, text, allow)
        ours = tokenizer.encode(text, allow)
        assert ids == ours, "pure-Python encoder disagrees with tiktoken on %r" % text
        assert tokenizer.decode_bytes(ids).decode("utf-8") == text, "round trip %r" % text
        assert encoding.decode(ids) == text
        cases.append({"text": text, "ids": ids, "allow_special": allow})
    return {"format_version": FORMAT_VERSION, "pattern": K3_PATTERN, "n_ranks": n_ranks,
            "cases": cases}
