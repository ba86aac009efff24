"""SGLang's page keys as kvoffload keys: a batch decoded at once gives exactly what
each key decoded alone gives, whatever the batch holds."""

from __future__ import annotations

import hashlib

from kvoffload.sglang.backend import page_key, page_keys


def hexes(n: int, salt: bytes = b"") -> list[str]:
    return [hashlib.sha256(salt + b"%d" % i).hexdigest() for i in range(n)]


def test_a_batch_of_page_hashes_decodes_as_each_hash_alone() -> None:
    for n in (1, 7, 8, 128, 1000):
        keys = hexes(n)
        assert page_keys(keys) == [bytes.fromhex(k) for k in keys]
    zeros = ["00" * 32, "ab" + "00" * 31] * 8  # trailing NUL bytes are kept
    assert page_keys(zeros) == [bytes(32), b"\xab" + bytes(31)] * 8


def test_a_batch_with_any_other_key_is_decoded_key_by_key() -> None:
    odd = [
        "x" * 64,  # 64 characters, not hex: hashed
        "ab " * 21 + "c",  # 64 characters with spaces fromhex would skip
        "short key",
        "AB" * 32,  # upper-case hex is hex
    ]
    for bad in odd:
        keys = hexes(16)
        keys[5] = bad
        assert page_keys(keys) == [page_key(k) for k in keys]
    assert page_keys(["AB" * 32] * 9) == [b"\xab" * 32] * 9
