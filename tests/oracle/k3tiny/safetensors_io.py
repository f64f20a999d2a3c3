"""A small safetensors writer and reader (not the `safetensors` package, on purpose: the layout
choices below are ours to make and to document).

File = u64 little-endian header length N, N bytes of JSON, then the data. The JSON maps each
tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to byte 8+N)
plus "__metadata__": {"format": "pt"}. The JSON is compact with sorted keys and padded with
spaces to a multiple of 8, so the data starts 8-aligned. Data is laid out in the order the
caller gives, which is NOT the (sorted) header order: readers must use data_offsets.
"""

import json
import struct

import numpy as np

# dtype name -> little-endian numpy dtype
DTYPES = {
    "BF16": np.dtype("<u2"),  # bf16 stored as raw bit patterns
    "F32": np.dtype("<f4"),
    "I32": np.dtype("<i4"),
    "U8": np.dtype("u1"),
}
HEADER_ALIGN = 8
HEADER_MAX = 100_000_000


class StoredTensor:
    """One tensor as stored: dtype name, shape and the array of stored values (uint16 bits for
    BF16)."""

    __slots__ = ("name", "dtype", "array")

    def __init__(self, name, dtype, array):
        assert dtype in DTYPES, dtype
        self.name = name
        self.dtype = dtype
        self.array = np.ascontiguousarray(array, dtype=DTYPES[dtype])

    @property
    def shape(self):
        return list(self.array.shape)

    @property
    def nbytes(self):
        return self.array.nbytes


def encode_header(tensors):
    """Header bytes (length prefix included) for tensors laid out in the given order."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        assert t.name not in header, "duplicate tensor " + t.name
        header[t.name] = {"dtype": t.dtype, "shape": t.shape,
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path, tensors):
    """Write tensors (a list of StoredTensor) in list order; return the data byte count."""
    with open(path, "wb") as f:
        f.write(encode_header(tensors))
        for t in tensors:
            f.write(t.array.tobytes())
    return sum(t.nbytes for t in tensors)


def read_safetensors(path):
    """Read a file back: {name: StoredTensor}, checking offsets tile the data exactly."""
    with open(path, "rb") as f:
        blob = f.read()
    assert len(blob) >= 8, path
    (n,) = struct.unpack("<Q", blob[:8])
    assert n <= HEADER_MAX and 8 + n <= len(blob), (path, n)
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    header.pop("__metadata__", None)
    data = blob[8 + n:]
    spans = []
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        count = int(np.prod(info["shape"], dtype=np.int64))
        assert end - begin == count * dtype.itemsize, (path, name)
        array = np.frombuffer(data[begin:end], dtype=dtype).reshape(info["shape"])
        out[name] = StoredTensor(name, info["dtype"], array)
        spans.append((begin, end))
    spans.sort()
    cursor = 0
    for begin, end in spans:
        assert begin == cursor, (path, "gap or overlap at", begin)
        cursor = end
    assert cursor == len(data), (path, "trailing bytes")
    return out
