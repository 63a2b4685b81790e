"""The numba kernel behind WhitespaceTokenizer.count_arrow: whitespace-separated tokens per string, counted
directly on an Arrow column's UTF-8 bytes. Imported only when numba is installed (nanscan.data.tokens)."""

from __future__ import annotations

import numba


@numba.njit(nogil=True, cache=True, inline="always")
def _multibyte_whitespace_width(data, i, end):
    # 0 when the multi-byte sequence at i is not whitespace, else its length (the list in tokens.WHITESPACE).
    lead = data[i]
    if lead == 0xC2:
        return 2 if i + 1 < end and (data[i + 1] == 0x85 or data[i + 1] == 0xA0) else 0
    if i + 2 >= end:
        return 0
    b1, b2 = data[i + 1], data[i + 2]
    if lead == 0xE1:
        return 3 if b1 == 0x9A and b2 == 0x80 else 0
    if lead == 0xE2:
        if b1 == 0x80 and (b2 <= 0x8A or b2 == 0xA8 or b2 == 0xA9 or b2 == 0xAF):
            return 3
        return 3 if b1 == 0x81 and b2 == 0x9F else 0
    return 3 if b1 == 0x80 and b2 == 0x80 else 0  # lead 0xE3: U+3000


@numba.njit(nogil=True, cache=True)
def count_words(data, starts, ends, byte_class, out):
    """out[r] = number of tokens in data[starts[r]:ends[r]]; byte_class as tokens._BYTE_CLASS."""
    for row in range(len(starts)):
        i, end = starts[row], ends[row]
        words, previous_is_space = 0, 1
        while i < end:
            cls = byte_class[data[i]]
            if cls == 2:
                width = _multibyte_whitespace_width(data, i, end)
                if width:
                    previous_is_space = 1
                    i += width
                    continue
                cls = 0
            # A token starts where a non-space byte follows a space (or the start): a branch-free count.
            words += previous_is_space & (cls ^ 1)
            previous_is_space = cls
            i += 1
        out[row] = words
