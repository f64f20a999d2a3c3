"""Number formats (bf16, MXFP4) and the small float64 math blocks of spec section 5."""

import numpy as np

# E2M1 magnitudes indexed by nibble bits 0-2 (spec section 4); bit 3 is the sign.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MXFP4_GROUP = 32
SCALE_NAN = 0xFF


# ---------------------------------------------------------------- bf16

def bf16_bits(x):
    """float64 array -> bf16 bit patterns (uint16), round to nearest even.

    The value is first rounded to f32 (numpy, RNE) and the f32 bits are then rounded to bf16:
    the stored bits define the model, and the reference reads them back, so the double
    rounding only has to be deterministic, not "the" nearest bf16 of the f64 draw.
    """
    x32 = np.asarray(x, dtype=np.float64).astype(np.float32)
    assert np.all(np.isfinite(x32)), "bf16_bits: non-finite input"
    bits = x32.view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    out = rounded.astype(np.uint16)
    assert np.all(np.isfinite(bf16_to_f64(out))), "bf16_bits: overflow to inf"
    return out


def bf16_to_f64(bits):
    """bf16 bit patterns (uint16) -> float64 (exact)."""
    wide = np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16
    return wide.view(np.float32).astype(np.float64)


def f32_to_f64(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


# ---------------------------------------------------------------- MXFP4

def mxfp4_decode(packed, scale, nibble_swap=False):
    """Decode an MXFP4 matrix [out, in] from weight_packed [out, in/2] and weight_scale
    [out, in/32] (both uint8).

    packed[o, j] holds element 2j in the LOW nibble and 2j+1 in the HIGH nibble; scale[o, g]
    is 2^(s-127) for elements 32g..32g+31. `nibble_swap` is the trap that reads the high
    nibble first.
    """
    packed = np.asarray(packed, dtype=np.uint8)
    scale = np.asarray(scale, dtype=np.uint8)
    n_out, n_half = packed.shape
    n_in = 2 * n_half
    assert scale.shape == (n_out, n_in // MXFP4_GROUP), (packed.shape, scale.shape)
    assert not np.any(scale == SCALE_NAN), "MXFP4 scale 0xFF is NaN: corrupt data"
    low, high = packed & 0x0F, packed >> 4
    if nibble_swap:
        low, high = high, low
    nibbles = np.empty((n_out, n_in), dtype=np.uint8)
    nibbles[:, 0::2] = low
    nibbles[:, 1::2] = high
    sign = np.where(nibbles & 0x8, -1.0, 1.0)
    values = sign * E2M1[nibbles & 0x7]
    factors = np.exp2(scale.astype(np.float64) - 127.0)
    return values * np.repeat(factors, MXFP4_GROUP, axis=1)


# ---------------------------------------------------------------- math blocks

def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def rms_norm(x, weight, eps):
    """w * x / sqrt(mean(x^2) + eps) over the last axis (the weight is not 1 + w)."""
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def l2_norm(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis: eps sits inside the sqrt."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def situ_glu(a, b, beta_gate=4.0, beta_up=25.0):
    """SiTU-GLU: [b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(b/b2)]; the sigmoid takes uncapped a."""
    return (beta_gate * np.tanh(a / beta_gate) * sigmoid(a)) * (beta_up * np.tanh(b / beta_up))


def softmax(x, axis=-1):
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)
