"""The per-sizes caches of a serving runner stay bounded on varlen traffic.

A continuous-batching engine calls with sizes that rarely repeat (a token count per step).
The static inputs cache the buffer views a call of given sizes copies into
(``StaticInputs._views``, ``_shapes``) and the views it re-pads (``_pad_views``, per sizes and
key), the output layout the output views of given sizes (``OutputLayout._views``), the
dispatcher its routes and the key space its choices: each starts over at
``keys.MEMO_LIMIT`` entries. Served with more distinct sizes than that, every cache stays at
or below it and every output equals eager; with the cap removed (the negative control) the
static inputs' and the output layout's caches grow past it, one entry per distinct sizes.
"""

from __future__ import annotations

import random

import pytest
import torch

import graphrunner.keys as keys_mod
import graphrunner.layout as layout_mod
import graphrunner.staging as staging_mod
from graphrunner.runner import BatchInput, GraphRunner

LIMIT = keys_mod.MEMO_LIMIT
CALLS = LIMIT + 1200  # more distinct sizes than any cache may hold (re-pads: most calls)


def two_dim_step(x, y):
    return x * 2.0 + y[:, None]


def one_dim_step(x):
    return x * 3.0 - 1.0


def _two_dim():
    """A (reqs, tokens) runner (re-padding a pad of 0 and one of 1) and CALLS distinct sizes."""
    runner = GraphRunner(
        two_dim_step,
        {"x": BatchInput(dims=("reqs", "tokens")), "y": BatchInput(dims=("reqs",), pad=1.0)},
        buckets={"reqs": [8, 64], "tokens": [16, 128]},
        progress=False,
    )
    sizes = [(r, t) for r in range(1, 65) for t in range(1, 129)]
    random.Random(0).shuffle(sizes)

    def call(s, g):
        x, y = torch.randn(*s, generator=g), torch.randn(s[0], generator=g)
        return runner(x=x, y=y), two_dim_step(x, y)

    return runner, sizes[:CALLS], call


def _one_dim():
    """A ``buckets=[...]`` runner whose inputs are (rows, *trailing) (the fast validation caches the
    expected shapes per row count) and CALLS distinct row counts."""
    runner = GraphRunner(one_dim_step, {"x": BatchInput(trailing=(2,))}, buckets=[1024, 8192], progress=False)
    sizes = [(n,) for n in range(1, 8193)]
    random.Random(1).shuffle(sizes)

    def call(s, g):
        x = torch.randn(s[0], 2, generator=g)
        return runner(x=x), one_dim_step(x)

    return runner, sizes[:CALLS], call


def _serve(make):
    runner, sizes, call = make()
    runner.capture()
    g = torch.Generator().manual_seed(2)
    for s in sizes:
        out, ref = call(s, g)
        assert torch.equal(out, ref), s
    assert runner.stats.fallbacks == 0
    return runner.server


@pytest.mark.parametrize("make", [_two_dim, _one_dim], ids=["reqs_tokens", "rows"])
def test_varlen_sizes_keep_every_per_sizes_cache_bounded_and_outputs_equal_eager(make):
    server = _serve(make)
    staging, layout = server.inputs, server.layout
    sizes_caches = {
        "staging views": staging._views,
        "staging re-pad views": staging._pad_views,
        "staging shapes": staging._shapes,
        "output views": layout._views,
        "routes": server.routes._routes,
        "key choices": server.space._memo,
    }
    assert {k: len(v) for k, v in sizes_caches.items() if len(v) > LIMIT} == {}
    # the caches were in use (each started over at least once where it is keyed per sizes)
    assert len(staging._views) > 0 and len(layout._views) > 0


@pytest.mark.parametrize("make", [_two_dim, _one_dim], ids=["reqs_tokens", "rows"])
def test_negative_control_without_the_cap_the_caches_grow_past_it(make, monkeypatch):
    monkeypatch.setattr(staging_mod, "MEMO_LIMIT", 10**9)
    monkeypatch.setattr(layout_mod, "MEMO_LIMIT", 10**9)
    server = _serve(make)
    staging = server.inputs
    assert len(staging._views) > LIMIT and len(server.layout._views) > LIMIT
    if make is _two_dim:
        assert len(staging._pad_views) > LIMIT
    else:
        assert len(staging._shapes) > LIMIT
