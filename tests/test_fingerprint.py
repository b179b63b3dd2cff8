"""graphrunner.checks.fingerprint.check in one process: ranks are threads joined by
a tiny in-memory group, so the message, the collective count and the text
packing are checked exactly (the gloo version is test_fingerprint_multirank)."""

from __future__ import annotations

import threading

from graphrunner.checks.fingerprint import check
from graphrunner.errors import CaptureError


class ThreadGroup:
    """``size`` threads; ``all_max_vector`` is an element-wise max over them."""

    def __init__(self, size):
        self.size, self.calls = size, []
        self._barrier = threading.Barrier(size)
        self._slots = [None] * size

    def member(self, rank):
        group = self

        class Member:
            size = group.size

            def __init__(self):
                self.rank = rank

            def all_max_vector(self, v, phase="", key=None):
                group._slots[rank] = list(v)
                group._barrier.wait()
                out = [max(col) for col in zip(*group._slots)]
                if rank == 0:
                    group.calls.append(phase)
                group._barrier.wait()
                return out

        return Member()


def run(fields_per_rank):
    g = ThreadGroup(len(fields_per_rank))
    errors = [None] * g.size

    def body(r):
        try:
            check(g.member(r), fields_per_rank[r], "configurations", key="config")
        except CaptureError as exc:
            errors[r] = str(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(g.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return errors, g.calls


def test_equal_fields_one_collective_and_no_error():
    f = {"buckets": [1, 2, 4], "inputs": {"x": "float32"}}
    errors, calls = run([f, dict(f), dict(f)])
    assert errors == [None, None, None] and calls == ["fingerprint"]


def test_differing_field_every_rank_names_field_ranks_and_values():
    a = {"buckets": [1, 2, 4], "warmups": 2}
    b = {"buckets": [1, 3, 4], "warmups": 2}
    errors, calls = run([a, b, a])
    assert calls == ["fingerprint", "fingerprint_values"]
    for r, e in enumerate(errors):
        assert e.startswith(
            f"rank {r} of 3: the ranks' configurations differ: 'buckets' differs (ranks 0, 2: [1,2,4]; rank 1: [1,3,4])"
        ), e
        assert "'warmups'" not in e


def test_long_and_unicode_values_survive_the_gather():
    a = {"inputs": "é" * 100 + "x" * 3000}
    b = {"inputs": "ü" * 100 + "y" * 9000}  # longer than the 4000 bytes gathered: truncated
    errors, _ = run([a, b])
    assert '"' + "é" * 100 + "x" * 3000 + '"' in errors[0]
    assert ("ü" * 100 + "y" * 100) in errors[1] and "y" * 9000 not in errors[1]


def test_one_rank_group_makes_no_call():
    class One:
        size, rank = 1, 0

        def all_max_vector(self, *a, **k):  # pragma: no cover - must not be called
            raise AssertionError

    check(One(), {"a": 1}, "configurations")
