#!/usr/bin/env python3
"""Generate a tiny random Kimi K3 checkpoint in the released file layout, plus the float64
reference outputs the k3ring engine is tested against. See tests/oracle/README.md.

    python3 tests/oracle/make_tiny.py --out DIR [--seed N] [--layers L] [--hidden D]
        [--experts E] [--topk K] [--attn-res-block B] [--vocab V] [--shards S]

Same arguments => byte-identical files. Needs numpy; tokenizer_cases.json also needs the Python
tiktoken package (use --no-tokenizer-cases to skip that file).
"""

import argparse
import os
import sys

# Single-threaded BLAS: the matrices are tiny (threads only cost time), and one thread keeps
# the float64 reduction order fixed from run to run.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

sys.dont_write_bytecode = True  # keep __pycache__ out of the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from k3tiny import checkpoint, evaluate, outputs  # noqa: E402
from k3tiny.corpus import PROMPTS, TRAINING_CORPUS  # noqa: E402
from k3tiny.dims import Dims, config_json, special_token_names, token_ids  # noqa: E402
from k3tiny.kda_crosscheck import crosscheck  # noqa: E402
from k3tiny.tokenizer import (Tokenizer, assign_ranks, tiktoken_model_text,  # noqa: E402
                              tokenizer_config, train_bpe)
from k3tiny.weights import make_shards  # noqa: E402

PROMPT_LEN_MIN, PROMPT_LEN_MAX = 12, 20   # tokens, BOS included
MAX_WEIGHT_VARIANTS = 4
EXIT_NO_FIXTURE = 1
EXIT_USAGE = 2
EXIT_NO_TIKTOKEN = 3


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (created if missing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=13)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--attn-res-block", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=768, help="BPE ranks + 256 added tokens")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--no-tokenizer-cases", action="store_true",
                    help="do not write tokenizer_cases.json (the only part needing tiktoken)")
    return ap.parse_args(argv)


def make_dims(args):
    dims = Dims(seed=args.seed, n_layers=args.layers, hidden=args.hidden,
                n_experts=args.experts, top_k=args.topk, attn_res_block=args.attn_res_block,
                vocab=args.vocab, n_shards=args.shards)
    dims.validate()
    return dims


def make_tokenizer(dims):
    """BPE merges come from the corpus alone; byte placement among the ranks from the seed."""
    merged = train_bpe(TRAINING_CORPUS, dims.n_ranks - 256)
    ranks = assign_ranks(merged, dims.n_ranks, np.random.default_rng([dims.seed, 0x544F4B]))
    specials = {text: i for i, text in special_token_names(dims.n_ranks).items()}
    return Tokenizer(ranks, specials)


def prompt_variants(tokenizer, bos):
    """BOS + each built-in prompt, or None where the length is outside the wanted range."""
    variants = []
    for text in PROMPTS:
        ids = [bos] + tokenizer.encode_ordinary(text)
        variants.append(ids if PROMPT_LEN_MIN <= len(ids) <= PROMPT_LEN_MAX else None)
    assert any(v is not None for v in variants), "no built-in prompt has a usable length"
    return variants


def find_fixture(dims, tokenizer, bos):
    """The first (weight variant, prompt variant) whose reference passes every property."""
    cache = {}

    def candidate(weight_variant):
        shards, noncontiguous = make_shards(dims, weight_variant)
        stored = {t.name: t for shard in shards for t in shard}
        cache[weight_variant] = (shards, noncontiguous)
        return stored, checkpoint.Model(dims, stored)

    variants = prompt_variants(tokenizer, bos)
    wv, pv, ev, rejected = evaluate.search(dims, candidate, variants, MAX_WEIGHT_VARIANTS)
    shards, noncontiguous = cache[wv]
    run = {"weight_variant": wv, "prompt_variant": pv, "evaluation": ev, "rejected": rejected}
    return run, shards, noncontiguous


def write_checkpoint(out_dir, dims, tokenizer, shards):
    ids = token_ids(dims)
    checkpoint.dump_json(os.path.join(out_dir, "config.json"), config_json(dims))
    checkpoint.write_text(os.path.join(out_dir, "tiktoken.model"),
                          tiktoken_model_text(tokenizer.ranks))
    checkpoint.dump_json(os.path.join(out_dir, "tokenizer_config.json"),
                         tokenizer_config(tokenizer.specials, ids["bos"], ids["eos"], ids["pad"]))
    checkpoint.write_shards(out_dir, shards)


def check_written(out_dir, shards):
    """Read the checkpoint back through the index: it must hold exactly the tensors the
    reference computed with."""
    stored = checkpoint.read_checkpoint(out_dir)
    assert checkpoint.stored_equal(stored, {t.name: t for s in shards for t in s})


def main(argv):
    args = parse_args(argv)
    try:
        dims = make_dims(args)
        tokenizer = make_tokenizer(dims)
    except ValueError as err:
        print("error: %s" % err, file=sys.stderr)
        return EXIT_USAGE
    os.makedirs(args.out, exist_ok=True)
    try:
        run, shards, noncontiguous = find_fixture(dims, tokenizer, token_ids(dims)["bos"])
    except RuntimeError as err:
        print("error: %s" % err, file=sys.stderr)
        return EXIT_NO_FIXTURE
    write_checkpoint(args.out, dims, tokenizer, shards)
    check_written(args.out, shards)
    prompt_text = PROMPTS[run["prompt_variant"]]
    # Only the arguments that shape the model: the output path and file selection do not.
    recorded_args = {k: v for k, v in sorted(vars(args).items())
                     if k not in ("out", "no_tokenizer_cases")}
    reference = outputs.reference_json(dims, run, prompt_text, token_ids(dims), noncontiguous,
                                       recorded_args)
    outputs.write_reference(args.out, reference, outputs.reference_tensors(dims, run["evaluation"]))
    report(reference)
    print(crosscheck(dims, dims.seed))
    return write_tokenizer_cases(args, dims, tokenizer, prompt_text)


def write_tokenizer_cases(args, dims, tokenizer, prompt_text):
    """tokenizer_cases.json, the one file that needs tiktoken. A skipped file is also removed,
    since an old one would hold ids of another tokenizer (byte ranks depend on the seed)."""
    path = os.path.join(args.out, outputs.TOKENIZER_CASES_NAME)
    cases = None if args.no_tokenizer_cases else outputs.tokenizer_cases(
        tokenizer, dims.n_ranks, prompt_text)
    if cases is not None:
        checkpoint.dump_json(path, cases)
        return 0
    if os.path.exists(path):
        os.remove(path)
    if args.no_tokenizer_cases:
        return 0
    print("error: tokenizer_cases.json needs the Python tiktoken package (pip install tiktoken); "
          "everything else was written to %s. Rerun with --no-tokenizer-cases to skip this file."
          % args.out, file=sys.stderr)
    return EXIT_NO_TIKTOKEN


def report(reference):
    """A short human summary on stdout (the files hold everything)."""
    stats = reference["stats"]
    print("prompt variant %d, weight variant %d: %d prompt tokens, greedy margin %.4f, "
          "teacher-forced margin %.4f" % (
              reference["generator"]["prompt_variant"], reference["generator"]["weight_variant"],
              len(reference["prompt_ids"]), stats["greedy_min_margin"],
              stats["teacher_forced_min_margin"]))
    print("bias reorders %.2f of routing decisions (set %.2f); SiTU gate cap reached: dense %.3f "
          "shared %.3f experts %.3f" % (
              stats["bias_reorder_fraction"], stats["bias_reorder_set_fraction"],
              stats["situ_gate_cap_fraction_dense"], stats["situ_gate_cap_fraction_shared"],
              stats["situ_gate_cap_fraction_experts"]))
    traps = ", ".join("%s %s" % (name, t["differing_positions"])
                      for name, t in sorted(reference["traps"].items()))
    print("trap differing positions: " + traps)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
