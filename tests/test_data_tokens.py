"""The whitespace token count is exactly len(str.split()), in the numba kernel over Arrow buffers and without it;
token-length statistics are exact nearest-rank quantiles."""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanscan.data import tokens as tokens_module
from nanscan.data.findings import TokenLengths
from nanscan.data.tokens import WHITESPACE, WhitespaceTokenizer

ALL_SPACES = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]


def test_whitespace_table_is_exactly_what_str_split_uses():
    assert sorted(WHITESPACE) == ALL_SPACES


@pytest.mark.parametrize("space", ALL_SPACES, ids=[f"U+{ord(c):04X}" for c in ALL_SPACES])
def test_every_whitespace_code_point_separates_tokens(space):
    texts = [f"a{space}b", f"{space}a{space}{space}", space, f"\u00e9{space}\u3001", f"x{space}"]
    got = WhitespaceTokenizer().count_arrow(pa.array(texts))
    assert got.tolist() == [len(t.split()) for t in texts]


def test_near_miss_bytes_are_not_whitespace():
    # Share a lead byte with a whitespace sequence but are not whitespace; also truncated-looking ends.
    texts = ["a\u00c2b", "a\u2080b", "a\u200bb", "a\u180eb", "a\u1681b", "a\u3001b", "a\u205eb", "\u2028", "\u00a0"]
    got = WhitespaceTokenizer().count_arrow(pa.array(texts))
    assert got.tolist() == [len(t.split()) for t in texts]


_ALPHABET = st.sampled_from(ALL_SPACES + list("ab\u00e9\u20ac\u200b\u00c2\u2080") + ["\U0001d538", "\x00"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(alphabet=_ALPHABET, max_size=20)), max_size=30),
       st.integers(0, 5), st.booleans())
def test_kernel_equals_str_split(texts, offset, large):
    arr = pa.array(texts, type=pa.large_string() if large else pa.string())
    arr = arr.slice(min(offset, len(arr)))
    expected = [0 if t is None else len(t.split()) for t in texts[min(offset, len(texts)):]]
    assert WhitespaceTokenizer().count_arrow(arr).tolist() == expected
    assert WhitespaceTokenizer().count_arrow(pa.chunked_array([arr, arr])).tolist() == expected * 2


def test_empty_and_all_null_columns():
    assert WhitespaceTokenizer().count_arrow(pa.array([], pa.string())).tolist() == []
    assert WhitespaceTokenizer().count_arrow(pa.array([None, None], pa.string())).tolist() == [0, 0]
    assert WhitespaceTokenizer().count_arrow(pa.chunked_array([], pa.string())).tolist() == []


def test_without_numba_the_same_counts(monkeypatch):
    monkeypatch.setattr(tokens_module, "_kernel", None)
    monkeypatch.setattr(tokens_module, "_kernel_error", ImportError("no numba"))
    texts = ["a b", "\u3000x\u3000", None, ""]
    assert WhitespaceTokenizer().count_arrow(pa.array(texts)).tolist() == [2, 1, 0, 0]


def test_token_lengths_quantiles_are_exact():
    t = TokenLengths()
    t.add(np.array([5, 1, 3]))
    t.add(np.array([100]))
    t.add(np.array([], dtype=np.int64))
    assert t.records == 4
    assert t.summary() == {"records": 4, "p50": 3, "p99": 100, "max": 100}
    assert TokenLengths().summary() == {"records": 0, "p50": None, "p99": None, "max": None}
    many = TokenLengths()
    many.add(np.arange(1, 101))
    assert (many.quantile(0.5), many.quantile(0.99), many.quantile(1.0)) == (50, 99, 100)
