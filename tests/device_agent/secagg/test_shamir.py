import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_agent.secagg import shamir
from device_agent.secagg.errors import ParameterError, ProtocolViolation


def _probably_prime(n: int, rounds: int = 40) -> bool:
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    rng = random.Random(0)
    for _ in range(rounds):
        x = pow(rng.randrange(2, n - 1), d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def test_field_is_the_smallest_prime_above_2_to_the_256():
    assert _probably_prime(shamir.PRIME)
    assert not any(_probably_prime((1 << 256) + k) for k in range(1, 297, 2))
    assert shamir.secret_to_int(b"\xff" * 32) < shamir.PRIME


def test_known_vector():
    # The worked example of Shamir's scheme over GF(1613) (Wikipedia, "Shamir's secret sharing"):
    # f(x) = 1234 + 166 x + 94 x^2 gives shares (1, 1494) (2, 329) (3, 965) (4, 176) (5, 1188) (6, 775).
    coefficients = iter([166, 94])
    shares = shamir.split(1234, 3, range(1, 7), prime=1613, randbelow=lambda _: next(coefficients))
    assert shares == {1: 1494, 2: 329, 3: 965, 4: 176, 5: 1188, 6: 775}
    assert shamir.combine({2: 329, 4: 176, 5: 1188}, 3, prime=1613) == 1234


@given(secret=st.binary(min_size=32, max_size=32), threshold=st.integers(1, 6), extra=st.integers(0, 4))
@settings(max_examples=40, deadline=None)
def test_any_threshold_shares_reconstruct(secret, threshold, extra):
    holders = random.Random(threshold).sample(range(1, 500), threshold + extra)
    shares = shamir.split(shamir.secret_to_int(secret), threshold, holders)
    for subset in itertools.islice(itertools.combinations(holders, threshold), 20):
        assert shamir.int_to_secret(shamir.combine({x: shares[x] for x in subset}, threshold)) == secret


def test_fewer_than_threshold_shares_fit_every_secret_equally():
    # Over GF(17) with t = 3: for fixed two shares, count the polynomials of each secret that produce them.
    prime, held = 17, {2: 5, 9: 11}
    counts = dict.fromkeys(range(prime), 0)
    for secret, a1, a2 in itertools.product(range(prime), repeat=3):
        if all((secret + a1 * x + a2 * x * x) % prime == y for x, y in held.items()):
            counts[secret] += 1
    assert set(counts.values()) == {1}  # each secret equally likely given t - 1 shares


def test_bad_arguments_are_named():
    with pytest.raises(ParameterError, match="threshold: 3 shares needed but only 2 holders"):
        shamir.split(5, 3, [1, 2])
    with pytest.raises(ParameterError, match="distinct"):
        shamir.split(5, 2, [1, 1, 2])
    with pytest.raises(ProtocolViolation, match="2 shares given, 3 needed"):
        shamir.combine({1: 1, 2: 2}, 3)
    with pytest.raises(ProtocolViolation, match="33 expected"):
        shamir.share_from_bytes(b"\x00" * 32)
