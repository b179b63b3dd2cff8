"""graphrunner.tape.proof.equal_ints (a memcmp of the bytes for large contiguous CPU integer tensors, the
comparison behind every check of an op's bits at capture) agrees with torch.equal, difference by difference."""

import pytest
import torch

import graphrunner.tape.proof as proof
from graphrunner.tape.proof import bits_equal, equal_ints

SIZES = [0, 1, 7, 1023, 1024, 1025, 4096, 1 << 16]


def _cases():
    g = torch.Generator().manual_seed(0)
    for n in SIZES:
        for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
            a = torch.randint(0, 100, (n,), dtype=dtype, generator=g)
            yield a, a.clone()  # equal, other memory
            yield a, a  # the same memory
            for at in {0, n // 2, n - 1} if n else ():
                b = a.clone()
                b[at] += 1  # one element differs: first, middle, last byte range
                yield a, b
            if n > 2:
                yield a[1:], a.clone()[1:]  # an offset view (contiguous)
                yield a[::2], a.clone()[::2]  # strided: torch.equal's path
                c = a.clone()
                c[n - 1] += 1
                yield a[::2] if (n - 1) % 2 else a[1::2], c[::2] if (n - 1) % 2 else c[1::2]
    big = torch.arange(1 << 14, dtype=torch.int32)
    yield big.view(128, 128), big.clone().view(128, 128).t().contiguous().t()  # equal values, other strides
    yield big.view(128, 128), big.view(128, 128).t()  # other values: a transposed view
    yield big.view(128, 128), big.view(16384)[: 128 * 128].view(128, 128)
    yield big, big.to(torch.int64)  # other dtype
    yield big.view(2, 8192), big.view(8192, 2)  # other shape, same bytes
    yield torch.zeros(5000, dtype=torch.bool), torch.zeros(5000, dtype=torch.bool)
    e = torch.zeros(5000, dtype=torch.bool)
    e[-1] = True
    yield torch.zeros(5000, dtype=torch.bool), e


@pytest.mark.parametrize("i", range(len(list(_cases()))))
def test_equal_ints_agrees_with_torch_equal(i):
    a, b = list(_cases())[i]
    assert equal_ints(a, b) == torch.equal(a, b)
    assert equal_ints(b, a) == torch.equal(b, a)


def test_large_contiguous_tensors_take_the_memcmp_path(monkeypatch):
    assert proof._MEMCMP is not None  # Linux: libc's memcmp
    a = torch.arange(1 << 14, dtype=torch.int32)
    b = a.clone()
    calls = []

    def no_equal(x, y):
        calls.append(1)
        return True

    monkeypatch.setattr(torch, "equal", no_equal)
    assert equal_ints(a, b)
    b[-1] += 1
    assert not equal_ints(a, b)  # the last byte is compared
    assert not calls


def test_short_compare_is_caught(monkeypatch):
    """Negative control: a memcmp that leaves out the last element passes a difference there."""
    real = proof._MEMCMP
    monkeypatch.setattr(proof, "_MEMCMP", lambda p, q, n: real(p, q, n - 4))
    a = torch.arange(1 << 14, dtype=torch.int32)
    b = a.clone()
    b[-1] += 1
    assert equal_ints(a, b) != torch.equal(a, b)


def test_bits_equal_floats():
    x = torch.randn(1 << 14)
    y = x.clone()
    assert bits_equal(x, y)
    y[-1] = -y[-1] if y[-1] != 0 else 1.0
    assert not bits_equal(x, y)
    z = torch.zeros(1 << 14)
    assert not bits_equal(z, -z)  # -0.0 != 0.0 bitwise
    n = torch.full((1 << 14,), float("nan"))
    assert bits_equal(n, n.clone())
    y = x.clone().view(torch.int32)
    y[5] ^= 1  # one payload bit
    assert not bits_equal(x, y.view(torch.float32))
