import sys

import numpy as np
import pytest

from device_agent.secagg import crypto
from device_agent.secagg.errors import ProtocolViolation


def test_both_ends_agree_on_a_key_bound_to_its_purpose():
    a, b = crypto.KeyPair.generate(), crypto.KeyPair.generate()
    key = crypto.agree(a.private, b.public, "mask", "round-1")
    assert key == crypto.agree(b.private, a.public, "mask", "round-1")
    assert key != crypto.agree(b.private, a.public, "mask", "round-2")
    assert crypto.KeyPair.from_private(a.private) == a


def test_sealed_share_opens_only_with_its_key_and_address():
    key = crypto.agree(crypto.KeyPair.generate().private, crypto.KeyPair.generate().public, "share")
    sealed = crypto.seal(key, b"share bytes", b"alice->bob")
    assert crypto.unseal(key, sealed, b"alice->bob") == b"share bytes"
    with pytest.raises(ProtocolViolation, match="does not authenticate"):
        crypto.unseal(key, sealed, b"alice->carol")
    with pytest.raises(ProtocolViolation):
        crypto.unseal(key, sealed[:-1] + bytes([sealed[-1] ^ 1]), b"alice->bob")


def test_chacha20_keystream_matches_rfc_7539():
    # RFC 7539 appendix A.1, test vector #1: all-zero key, nonce and block counter; keystream 76 b8 e0 ad a0 f1 ...
    words = crypto.expand(bytes(32), 4, 32)
    assert [int(w) for w in words] == [0xADE0B876, 0x903DF1A0, 0xE56A5D40, 0x28BD8653]


def test_mask_is_uniform_in_the_ring_and_reproducible():
    seed = bytes(range(32))
    mask = crypto.expand(seed, 100_000, 25)
    assert np.array_equal(mask, crypto.expand(seed, 100_000, 25))
    assert int(mask.max()) < 2**25 and abs(float(mask.mean()) / 2**24 - 1) < 0.01
    assert crypto.expand(seed, 10, 64).dtype == np.uint64


def test_missing_cryptography_names_the_extra(monkeypatch):
    crypto._lib.cache_clear()
    for name in [name for name in sys.modules if name.split(".")[0] == "cryptography"]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of any of them now fails as if not installed
    try:
        with pytest.raises(ImportError, match=r"pip install 'fedfleet\[secagg\]'"):
            crypto.KeyPair.generate()
    finally:
        crypto._lib.cache_clear()
