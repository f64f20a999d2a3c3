"""k3tiny: a float64 reference ("oracle") for the k3ring engine, plus a generator for a tiny
random Kimi K3 checkpoint in the released file layout.

Only numpy is needed, except for `tokenizer_cases.json`, whose ids come from the Python
`tiktoken` package (see README.md). Module map:

- dims.py        sizes of the tiny model and its config.json
- numerics.py    bf16 rounding, MXFP4 decode, the small math helpers (RMSNorm, SiTU-GLU, ...)
- safetensors_io.py  our own safetensors writer and reader
- tokenizer.py   the K3 pre-tokenizer, BPE training and a tiktoken-semantics encoder
- corpus.py      built-in texts: BPE training corpus, prompts, tokenizer test cases
- weights.py     seeded random weights and their placement in shards
- checkpoint.py  writing the checkpoint files and loading them back as float64 arrays
- reference.py   the forward pass of spec section 5, with trap flags
- evaluate.py    prompt/greedy runs, statistics, trap runs and the property checks
- outputs.py     reference.json, reference.safetensors, tokenizer_cases.json
- kda_crosscheck.py  optional cross-check of the KDA recurrence against fla-core (needs torch)
"""
