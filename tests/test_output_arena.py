"""Several runners of one model share one output arena (issue 8 item 4).

Reference: eager ``step`` on the same inputs. The arena's memory claim is
checked against a hand sum of the output buffers' bytes.
"""

import pytest
import torch

import graphrunner as gr
from graphrunner.arena import ALIGN

H, V = 8, 13


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(H, V, generator=g), torch.randn(V, H, generator=g)


W, U = _weights()


def decode(x):  # [batch, H] -> logits [batch, V]
    return {"logits": torch.tanh(x) @ W}


def verify(x):  # [reqs, draft, H] -> logits [reqs, draft, V], hidden [reqs, draft, H]
    h = torch.tanh(x)
    return {"logits": h @ W, "hidden": (h @ W) @ U}


def _runners(arena, device, backend="full", **kw):
    dec = gr.GraphRunner(
        decode,
        inputs={"x": gr.BatchInput(trailing=(H,))},
        buckets=[1, 2, 4],
        backend=backend,
        device=device,
        progress=False,
        output_arena=arena,
        **kw,
    )
    ver = gr.GraphRunner(
        verify,
        inputs={"x": gr.BatchInput(trailing=(H,), dims=("reqs", "draft"))},
        buckets={"reqs": [1, 2, 4], "draft": [1, 3]},
        backend=backend,
        device=device,
        progress=False,
        output_arena=arena,
        outputs=("reqs", "draft"),
        **kw,
    )
    return dec, ver


def _padded(t, *sizes):
    """``t`` zero-padded to ``sizes`` on its leading dims (what the graph of that key computes on)."""
    out = torch.zeros(*sizes, *t.shape[len(sizes) :])
    out[tuple(slice(0, n) for n in t.shape[: len(sizes)])] = t
    return out


def _nbytes(*shapes):
    return sum((torch.Size(s).numel() * 4 + ALIGN - 1) // ALIGN * ALIGN for s in shapes)


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_runners_on_one_arena_hold_the_max_not_the_sum_and_equal_eager(backend):
    arena = gr.OutputArena("model")
    dev = gr.get_device("tape")  # one device object: one graph pool for both runners
    dec, ver = _runners(arena, dev, backend)
    rv = ver.capture()  # largest outputs first
    rd = dec.capture()
    need_ver = _nbytes((4, 3, V), (4, 3, H))
    need_dec = _nbytes((4, V))
    assert sorted(arena.bytes_needed) == sorted([need_ver, need_dec])
    assert arena.bytes_held == max(need_ver, need_dec)  # shared: the max
    assert arena.bytes_if_separate == need_ver + need_dec  # one buffer each: the sum
    assert rd.output_arena["bytes_held"] == arena.bytes_held and rd.output_arena["owners"] == 2
    assert "share" in rd.table() and "separate buffers would hold" in rd.table()
    assert rv.to_dict()["output_arena"]["name"] == "model"
    g = torch.Generator().manual_seed(1)
    for n, (r, d) in zip([3, 1, 4, 2], [(3, 2), (1, 1), (4, 3), (2, 3)]):
        x = torch.randn(n, H, generator=g)
        y = torch.randn(r, d, H, generator=g)
        out_d = dec(x=x)
        out_v = ver(x=y)
        # copies by default: the verify replay did not overwrite decode's result
        bd, (br, bdr) = dec.bucket_for(n), ver.key_for((r, d))
        assert torch.equal(out_d["logits"], decode(_padded(x, bd))["logits"][:n])
        ref = verify(_padded(y, br, bdr))
        for k in ("logits", "hidden"):
            assert torch.equal(out_v[k], ref[k][:r, :d])
    assert dec.stats.replays[4] >= 1 and ver.stats.replays[(4, 3)] >= 1


def test_negative_control_views_into_a_shared_arena_are_overwritten_by_the_other_runner():
    """copy_outputs=False on a shared arena: the other runner's replay rewrites the view (why copies are the default)."""
    arena = gr.OutputArena()
    dev = gr.get_device("tape")
    dec, ver = _runners(arena, dev, copy_outputs=False)
    ver.capture()
    dec.capture()
    x = torch.randn(4, H)
    out_d = dec(x=x)
    kept = out_d["logits"].clone()
    ver(x=torch.randn(4, 3, H))
    assert not torch.equal(out_d["logits"], kept)  # silently changed: the shared memory was reused
    # and without an arena the same sequence leaves it alone
    dec2, ver2 = _runners(None, dev, copy_outputs=False)
    ver2.capture()
    dec2.capture()
    out2 = dec2(x=x)
    kept2 = out2["logits"].clone()
    ver2(x=torch.randn(4, 3, H))
    assert torch.equal(out2["logits"], kept2)


def test_smaller_runner_first_outgrows_the_block_and_says_so():
    arena = gr.OutputArena()
    dev = gr.get_device("tape")
    dec, ver = _runners(arena, dev)
    dec.capture()
    rv = ver.capture()
    assert arena.outgrown == 1
    assert arena.bytes_held == arena.bytes_if_separate  # both blocks alive: no saving
    assert "capture the runner with the largest outputs first" in rv.table()
    x = torch.randn(2, H)
    assert torch.equal(
        dec(x=x)["logits"], decode(x)["logits"]
    )  # bucket 2 = the batch; still correct, on its own old block


def test_cleanup_releases_the_claim():
    arena = gr.OutputArena()
    dec, ver = _runners(arena, gr.get_device("tape"))
    ver.capture()
    dec.capture()
    assert arena.owners == 2
    ver.cleanup()
    # decode's buffer still lives in the block verify sized: the block stays, the claim goes
    assert arena.owners == 1 and arena.bytes_needed == [_nbytes((4, V))]
    assert arena.bytes_held == _nbytes((4, 3, V), (4, 3, H))


def test_bad_output_arena_is_a_type_error():
    with pytest.raises(TypeError, match="output_arena must be a gr.OutputArena"):
        gr.GraphRunner(decode, inputs={"x": gr.BatchInput(trailing=(H,))}, buckets=[1], output_arena=object())
    backend = gr.backends.FullGraphBackend(device="tape")
    with pytest.raises(ValueError, match="output_arena= was given together with a backend instance"):
        gr.GraphRunner(
            decode,
            inputs={"x": gr.BatchInput(trailing=(H,))},
            buckets=[1],
            backend=backend,
            output_arena=gr.OutputArena(),
        )
