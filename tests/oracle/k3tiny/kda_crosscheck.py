"""Optional: the KDA delta rule of reference.py against `naive_recurrent_kda` from fla-core.

`fla` itself needs triton to import, so the file fla/ops/kda/naive.py is loaded by path from
the installed package. Without torch (or fla-core, or einops) this is skipped with one line.
"""

import importlib.util
import os

import numpy as np

from .reference import KdaState, delta_rule

TOLERANCE = 1e-4   # fla's naive kernel computes in float32; ours in float64


def load_naive_kda():
    """naive_recurrent_kda, or a string saying why it is unavailable."""
    try:
        import torch  # noqa: F401  (needed by naive.py)
    except ImportError:
        return "torch is not installed"
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return "fla-core is not installed"
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
    if not os.path.exists(path):
        return "fla-core has no ops/kda/naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except ImportError as err:
        return "cannot load %s: %s" % (path, err)
    return module.naive_recurrent_kda


def crosscheck(dims, seed, steps=12):
    """Returns a one-line result: the max difference, or why it was skipped."""
    naive = load_naive_kda()
    if isinstance(naive, str):
        return "KDA cross-check skipped: " + naive
    import torch
    rng = np.random.default_rng([seed, 0x4B4441])
    heads, k = dims.kda_heads, dims.kda_head_dim
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((steps, heads, k)))
    kk = unit(rng.standard_normal((steps, heads, k)))
    v = rng.standard_normal((steps, heads, k))
    g = -5.0 * rng.uniform(0.0, 1.0, (steps, heads, k))       # log decay, as fla takes it
    beta = rng.uniform(0.0, 1.0, (steps, heads))
    ours = delta_rule(KdaState(dims), q * k ** -0.5, kk, v, np.exp(g), beta, False)
    as_torch = lambda x: torch.tensor(x[None], dtype=torch.float32)
    theirs, _ = naive(q=as_torch(q), k=as_torch(kk), v=as_torch(v), g=as_torch(g),
                      beta=as_torch(beta), scale=k ** -0.5)
    err = float(np.max(np.abs(theirs[0].double().numpy() - ours)))
    assert err < TOLERANCE, "KDA recurrence differs from fla naive_recurrent_kda by %g" % err
    return "KDA cross-check against fla naive_recurrent_kda: max error %.2e" % err
