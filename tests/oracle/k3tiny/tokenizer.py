"""The K3 tokenizer in pure Python: pre-tokenizer, BPE training and tiktoken-semantics encoding.

The pre-tokenizer is a hand-written matcher for the K3 regex (spec section 6), because Python's
`re` has no \\p{...} classes and the `regex` module is not available. It follows the regex's
leftmost-first semantics alternative by alternative, backtracking the way the regex engine would.
When the Python `tiktoken` package is present, every encoding is cross-checked against it (the
package runs the real regex through fancy-regex, as the Rust engine's tiktoken-rs does).

Unicode properties come from Python's unicodedata (general categories) plus the Han script
ranges below; characters assigned after Unicode 14 are not used by any built-in text.
"""

import base64
import functools
import unicodedata

# The K3 pre-tokenizer regex, alternative by alternative (spec section 6).
K3_PATTERNS = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
K3_PATTERN = "|".join(K3_PATTERNS)

# Unicode White_Space (what \s means in Rust's regex crate; str.isspace() differs).
WHITE_SPACE = frozenset(
    [chr(c) for c in range(0x09, 0x0E)]
    + [chr(c) for c in (0x20, 0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000)]
    + [chr(c) for c in range(0x2000, 0x200B)]
)

# Script=Han code point ranges (Unicode 15 Scripts.txt), inclusive.
HAN_RANGES = (
    (0x2E80, 0x2E99), (0x2E9B, 0x2EF3), (0x2F00, 0x2FD5), (0x3005, 0x3005), (0x3007, 0x3007),
    (0x3021, 0x3029), (0x3038, 0x303B), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFA6D),
    (0xFA70, 0xFAD9), (0x16FE2, 0x16FE3), (0x16FF0, 0x16FF1), (0x20000, 0x2A6DF),
    (0x2A700, 0x2B739), (0x2B740, 0x2B81D), (0x2B820, 0x2CEA1), (0x2CEB0, 0x2EBE0),
    (0x2F800, 0x2FA1D), (0x30000, 0x3134A), (0x31350, 0x323AF),
)

# (?i:...) contractions in alternation order; Unicode simple case folding makes 's' also match
# 'S' and U+017F LONG S. No other letter used here has a non-ASCII fold.
CONTRACTIONS = ("s", "t", "re", "ve", "m", "ll", "d")
FOLDS = {"s": "sS\u017f", "t": "tT", "r": "rR", "e": "eE", "v": "vV", "m": "mM", "l": "lL",
         "d": "dD"}


# ---------------------------------------------------------------- character classes

@functools.lru_cache(maxsize=None)
def char_class(ch):
    """Return (han, letter_upper, letter_lower, number, prefix, punct, space) flags.

    letter_upper = [\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]],
    letter_lower = [\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]],
    prefix = [^\\r\\n\\p{L}\\p{N}], punct = [^\\s\\p{L}\\p{N}].
    """
    cp = ord(ch)
    cat = unicodedata.category(ch)
    han = any(lo <= cp <= hi for lo, hi in HAN_RANGES)
    is_letter = cat.startswith("L")
    is_mark = cat.startswith("M")
    number = cat.startswith("N")
    upper = (cat in ("Lu", "Lt", "Lm", "Lo") or is_mark) and not han
    lower = (cat in ("Ll", "Lm", "Lo") or is_mark) and not han
    space = ch in WHITE_SPACE
    prefix = ch not in "\r\n" and not is_letter and not number
    punct = not space and not is_letter and not number
    return han, upper, lower, number, prefix, punct, space


def _is(ch, index):
    return char_class(ch)[index]


HAN, UPPER, LOWER, NUMBER, PREFIX, PUNCT, SPACE = range(7)


def _run(text, start, kind, limit=None):
    """Length of the run of `kind` characters starting at `start` (at most `limit`)."""
    end = start
    while end < len(text) and _is(text[end], kind):
        end += 1
        if limit is not None and end - start == limit:
            break
    return end - start


# ---------------------------------------------------------------- the alternatives

def _contraction(text, pos):
    """End of an optional (?i:'s|'t|'re|'ve|'m|'ll|'d) at pos (first alternative wins)."""
    if pos >= len(text) or text[pos] != "'":
        return pos
    for word in CONTRACTIONS:
        chunk = text[pos + 1:pos + 1 + len(word)]
        if len(chunk) == len(word) and all(c in FOLDS[w] for c, w in zip(chunk, word)):
            return pos + 1 + len(word)
    return pos


def _word_lower_body(text, s):
    """UPPER* LOWER+ at s, backtracking UPPER* from longest to shortest. End or None."""
    longest = _run(text, s, UPPER)
    for m in range(longest, -1, -1):
        j = s + m
        if j < len(text) and _is(text[j], LOWER):
            return j + _run(text, j, LOWER)
    return None


def _word_upper_body(text, s):
    """UPPER+ LOWER* at s (LOWER* cannot fail, so no backtracking is needed). End or None."""
    m = _run(text, s, UPPER)
    if m == 0:
        return None
    return s + m + _run(text, s + m, LOWER)


def _word(text, i, body):
    """PREFIX? body CONTRACTION?: try with the optional prefix first, then without."""
    starts = [i + 1, i] if _is(text[i], PREFIX) else [i]
    for s in starts:
        end = body(text, s)
        if end is not None:
            return _contraction(text, end)
    return None


def _punct(text, i):
    """' ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*'."""
    for s in ([i + 1, i] if text[i] == " " else [i]):
        m = _run(text, s, PUNCT)
        if m:
            end = s + m
            while end < len(text) and text[end] in "\r\n":
                end += 1
            return end
    return None


def _space_newline(text, i):
    """'\\s*[\\r\\n]+': greedy \\s* backs off to the last newline of the whitespace run."""
    w = _run(text, i, SPACE)
    for m in range(w - 1, -1, -1):
        if text[i + m] in "\r\n":
            return i + m + 1
    return None


def _space_not_before_text(text, i):
    """'\\s+(?!\\S)': the whole run at the end of text, else the run less its last char."""
    w = _run(text, i, SPACE)
    if w and i + w == len(text):
        return i + w
    if w >= 2:
        return i + w - 1
    return None


def _space(text, i):
    w = _run(text, i, SPACE)
    return i + w if w else None


def _han(text, i):
    w = _run(text, i, HAN)
    return i + w if w else None


def _number(text, i):
    w = _run(text, i, NUMBER, limit=3)
    return i + w if w else None


ALTERNATIVES = (
    _han,
    lambda text, i: _word(text, i, _word_lower_body),
    lambda text, i: _word(text, i, _word_upper_body),
    _number,
    _punct,
    _space_newline,
    _space_not_before_text,
    _space,
)


def split_pieces(text):
    """Pre-tokenize text into pieces, as regex find_iter with K3_PATTERN would."""
    pieces = []
    i = 0
    while i < len(text):
        for alternative in ALTERNATIVES:
            end = alternative(text, i)
            if end is not None:
                break
        else:
            raise ValueError("no pre-tokenizer alternative matches %r" % text[i])
        assert end > i
        pieces.append(text[i:end])
        i = end
    return pieces


# ---------------------------------------------------------------- BPE

def bpe_merge(piece, ranks):
    """tiktoken semantics: repeatedly merge the adjacent pair whose concatenation has the lowest
    rank (leftmost on ties) until no pair is a token. Returns the token ids."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


class Tokenizer:
    """Byte-level BPE with tiktoken semantics plus added (special) tokens."""

    def __init__(self, ranks, specials):
        self.ranks = dict(ranks)            # bytes -> rank
        self.specials = dict(specials)      # str -> id
        self.decoder = {r: b for b, r in self.ranks.items()}
        for text, token_id in self.specials.items():
            self.decoder[token_id] = text.encode("utf-8")
        assert len(self.decoder) == len(self.ranks) + len(self.specials)

    def encode_ordinary(self, text):
        ids = []
        for piece in split_pieces(text):
            ids.extend(bpe_merge(piece.encode("utf-8"), self.ranks))
        return ids

    def encode(self, text, allow_special):
        """Ordinary encoding, or with added tokens recognised anywhere when allow_special."""
        if not allow_special:
            return self.encode_ordinary(text)
        ids = []
        pos = 0
        while pos <= len(text):
            hits = [(text.find(s, pos), -len(s), s) for s in self.specials]
            hits = [h for h in hits if h[0] >= 0]
            if not hits:
                break
            start, _, special = min(hits)
            ids.extend(self.encode_ordinary(text[pos:start]))
            ids.append(self.specials[special])
            pos = start + len(special)
        ids.extend(self.encode_ordinary(text[pos:]))
        return ids

    def decode_bytes(self, ids):
        return b"".join(self.decoder[i] for i in ids)


def train_bpe(text, n_merges):
    """Deterministic byte-level BPE: merge the most frequent adjacent pair (ties: smallest pair
    of byte strings) over the pre-tokenized corpus. Returns the merged tokens in merge order.

    Pair counts are updated incrementally (only words containing the merged pair are touched),
    which keeps training well under a second.
    """
    counts = {}
    for piece in split_pieces(text):
        key = tuple(bytes([b]) for b in piece.encode("utf-8"))
        counts[key] = counts.get(key, 0) + 1
    words = [list(w) for w in sorted(counts)]
    freqs = [counts[tuple(w)] for w in words]
    pair_count, where = {}, {}
    for index, word in enumerate(words):
        _add_pairs(word, freqs[index], index, pair_count, where)
    merged = []
    seen = set(bytes([b]) for b in range(256))
    while len(merged) < n_merges and pair_count:
        best = min(pair_count, key=lambda p: (-pair_count[p], p))
        for index in sorted(where.pop(best, ())):
            _add_pairs(words[index], -freqs[index], index, pair_count, where)
            words[index] = _merge_word(words[index], best)
            _add_pairs(words[index], freqs[index], index, pair_count, where)
        pair_count.pop(best, None)
        token = best[0] + best[1]
        if token not in seen:
            seen.add(token)
            merged.append(token)
    if len(merged) < n_merges:
        raise ValueError("the built-in corpus supports only %d BPE merges; use a smaller --vocab"
                         " (at most %d)" % (len(merged), 256 + len(merged) + 256))
    return merged


def _add_pairs(word, delta, index, pair_count, where):
    for pair in zip(word, word[1:]):
        total = pair_count.get(pair, 0) + delta
        if total:
            pair_count[pair] = total
        else:
            pair_count.pop(pair, None)
        if delta > 0:
            where.setdefault(pair, set()).add(index)
        # On removal the index may stay in `where` (the word may hold the pair twice, or a
        # later merge may not touch it): a stale index costs one no-op re-count, nothing more.


def _merge_word(word, pair):
    out = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def assign_ranks(merged, n_ranks, rng):
    """Ranks for the 256 single bytes plus the merged tokens (in merge order).

    The bytes are spread over seeded positions among all ranks, in a seeded order with no byte
    at rank == its value, so an engine that confuses byte values with ranks fails visibly. Byte
    ranks never take part in merging (only pairs are looked up), so this is free.
    """
    assert len(merged) == n_ranks - 256
    byte_slots = sorted(rng.choice(n_ranks, size=256, replace=False).tolist())
    for _ in range(100):
        order = rng.permutation(256).tolist()
        if all(slot != value for slot, value in zip(byte_slots, order)):
            break
    else:
        raise AssertionError("could not place bytes away from rank == byte value")
    ranks = {bytes([value]): slot for slot, value in zip(byte_slots, order)}
    free = [r for r in range(n_ranks) if r not in set(byte_slots)]
    for token, rank in zip(merged, free):
        ranks[token] = rank
    assert sorted(ranks.values()) == list(range(n_ranks))
    return ranks


# ---------------------------------------------------------------- files

def tiktoken_model_text(ranks):
    """tiktoken.model: one 'base64(bytes) rank' line per token, in rank order."""
    lines = ["%s %d\n" % (base64.b64encode(b).decode("ascii"), r)
             for b, r in sorted(ranks.items(), key=lambda item: item[1])]
    return "".join(lines)


def tokenizer_config(specials, bos, eos, pad):
    """An HF-style tokenizer_config.json with the 256 added tokens."""
    decoder = {}
    for text, token_id in sorted(specials.items(), key=lambda item: item[1]):
        decoder[str(token_id)] = {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    by_id = {token_id: text for text, token_id in specials.items()}
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [by_id[i] for i in sorted(by_id)[2:6]],
        "bos_token": by_id[bos],
        "clean_up_tokenization_spaces": False,
        "eos_token": by_id[eos],
        "model_max_length": 4096,
        "pad_token": by_id[pad],
        "tokenizer_class": "TikTokenTokenizer",
    }


def package_encoding(ranks, specials):
    """The Python tiktoken Encoding for these ranks, or None when tiktoken is not installed."""
    try:
        import tiktoken
    except ImportError:
        return None
    return tiktoken.Encoding(name="tiny-k3", pat_str=K3_PATTERN, mergeable_ranks=dict(ranks),
                             special_tokens=dict(specials))


def package_encode(encoding, text, allow_special):
    if allow_special:
        return encoding.encode(text, allowed_special="all")
    return encoding.encode(text, allowed_special=set(), disallowed_special=())
