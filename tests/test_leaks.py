"""The padding-leak check at capture (graphrunner.checks.padding), with negative controls."""

import pytest
import torch

import graphrunner as gr
from graphrunner.checks.padding import check_sizes
from graphrunner.keys import KeySpace
from graphrunner.tape import is_tape_capturing

H = 4


def _bias():
    return torch.randn(H, generator=torch.Generator().manual_seed(1))


def _sum_step():
    b = _bias()

    def step(h):
        y = torch.tanh(h + b)  # padding rows (h = 0) give tanh(b) != 0
        return {"rows": y, "total": y.sum()}

    return step


def _runner(step, **kw):
    return gr.GraphRunner(
        step,
        inputs={"h": gr.BatchInput(trailing=(H,), pad=0.0)},
        buckets=[1, 2, 4, 8],
        device="tape",
        progress=False,
        **kw,
    )


def test_sum_over_batch_is_caught_naming_output_and_key():
    r = _runner(_sum_step())
    with pytest.raises(gr.CaptureError) as ei:
        r.capture()
    msg = str(ei.value)
    assert isinstance(ei.value, gr.PaddingLeakError)
    assert "output['total']" in msg and "bucket 8" in msg and "output['rows']" not in msg
    assert "gr.PaddingCheck(exempt=('total',))" in msg and 'leaving "padding" out of GraphRunner(checks=...)' in msg
    assert not r.captured


def test_negative_control_check_off_returns_padding_in_the_sum():
    step = _sum_step()
    r = _runner(step, checks=("drift", "fingerprint"))
    r.capture()
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    out = r(h=x)
    eager = step(x)
    torch.testing.assert_close(out["rows"], eager["rows"])  # real rows are right ...
    assert abs(float(out["total"]) - float(eager["total"])) > 0.1  # ... the 0-dim sum silently is not
    padded = torch.cat([x, torch.zeros(1, H)])  # it is the sum over bucket 4
    torch.testing.assert_close(out["total"], step(padded)["total"])


def test_exempt_output_is_not_compared_and_keeps_its_slicing():
    step = _sum_step()
    r = _runner(step, checks=["drift", gr.PaddingCheck(exempt=("total",)), "fingerprint"])
    r.capture()
    x = torch.randn(3, H)
    out = r(h=x)
    torch.testing.assert_close(out["rows"], step(x)["rows"])
    torch.testing.assert_close(out["total"], step(torch.cat([x, torch.zeros(1, H)]))["total"])


def test_exempting_one_output_still_checks_the_others():
    b = _bias()

    def step(h):
        y = torch.tanh(h + b)
        return {"total": y.sum(), "mean_rows": y - y.mean(0)}  # mean_rows leaks too

    with pytest.raises(gr.PaddingLeakError, match=r"output\['mean_rows'\]"):
        _runner(step, checks=["drift", gr.PaddingCheck(exempt=("total",)), "fingerprint"]).capture()
    _runner(
        step, checks=["drift", gr.PaddingCheck(exempt=("total", "output['mean_rows']")), "fingerprint"]
    ).capture()  # paths work too
    with pytest.raises(TypeError, match=r"PaddingCheck\(exempt=...\) entries"):
        _runner(step, checks=["drift", gr.PaddingCheck(exempt=(1,)), "fingerprint"])


def test_row_independent_step_passes_and_matches_eager():
    w = torch.randn(H, H)

    def step(h):
        y = torch.tanh(h @ w)
        return y, (y * 2).amax(-1)

    r = _runner(step)
    rep = r.capture()
    checked = {b.bucket: b.info.get("leak_check_sizes") for b in rep.buckets}
    assert checked == {8: [5], 4: [3], 2: None, 1: None}  # bucket 2: previous bucket 1 + 1 = 2, no padding
    x = torch.randn(3, H)
    a, m = r(h=x)
    torch.testing.assert_close(a, torch.tanh(x @ w))
    torch.testing.assert_close(m, (torch.tanh(x @ w) * 2).amax(-1))


def test_integer_inputs_vary_within_bounds_and_keep_their_pad_without(caplog):
    """Integer inputs with bounds get random real cells inside them (one real cell at the pad, which
    is a valid real value here), padding cells their pad value, as at replay; without bounds they keep
    the pad value and one warning says what to declare."""
    emb = torch.randn(10, H)
    seen = []

    def step(ids, h):
        if not is_tape_capturing():  # the eager forwards (a capture may hold poison: GRAPHRUNNER_TAPE_POISON=1)
            seen.append(ids.clone())
        return emb[ids] + h

    def build(bounds):
        return gr.GraphRunner(
            step,
            inputs={
                "ids": gr.BatchInput(dtype=torch.long, pad=0, bounds=bounds),
                "h": gr.BatchInput(trailing=(H,), pad=0.0),
            },
            buckets=[2, 4],
            device="tape",
            progress=False,
            checks=("padding", "fingerprint"),
        )  # the step branches on the capture on purpose

    build((0, 9)).capture()
    varied = [t for t in seen if int(t.max()) > 0]
    assert varied and all(0 <= int(t.min()) and int(t.max()) <= 9 for t in seen)
    # the pad is a real value: no real cell of runs A to D holds it (a padding row alone at the pad), one
    # real cell of the follow-up does (a real request at the padding rows' index)
    assert any(t.shape[0] == 3 and 0 not in t.tolist() for t in varied)  # D, unpadded
    assert any(t.shape[0] == 3 and int(t[0]) == 0 for t in varied)  # the follow-up, unpadded
    assert any(t.shape[0] == 4 and int(t[3]) == 0 and int(t[:3].max()) > 0 for t in varied)  # padding = pad
    seen.clear()
    with caplog.at_level("WARNING", logger="graphrunner.checks.padding"):
        build(None).capture()
    assert all(int(t.max()) == 0 for t in seen)
    assert "integer input(s) 'ids' have no BatchInput(bounds=(lo, hi))" in caplog.text
    assert caplog.text.count("have no BatchInput(bounds") == 1  # one warning per runner


def test_state_the_step_writes_is_put_back_around_the_checks_forwards(caplog, monkeypatch):
    """The check's forwards run with the step's writes outside itself put back (a WriteGuard), so a
    tensor the step updates in place is no false alarm, with or without a reset hook; the user's hook
    runs after each warmup only. Negative control: without the restore the check sees the output move
    between two identical calls and can only warn that it cannot check it."""
    from graphrunner.recording.ops import WriteGuard

    counter = torch.zeros(())

    def step(h):
        counter.add_(1)  # state the step writes
        return h * 2 + counter

    hooks = []
    r = _runner(step, post_warmup_hook=lambda bucket: (hooks.append(bucket), counter.zero_()))
    r.capture()
    assert hooks == [8, 8, 4, 4, 2, 2, 1, 1]
    counter.zero_()
    with caplog.at_level("WARNING", logger="graphrunner.checks.padding"):
        r = _runner(step)
        r.capture()
    assert "changed between two identical calls" not in caplog.text
    h = torch.randn(3, *r.inputs["h"].trailing)
    got = r(h=h)
    assert torch.equal(got, h * 2 + counter)  # the graph adds the live counter (updated in the graph)
    monkeypatch.setattr(WriteGuard, "restore", lambda self: None)
    with caplog.at_level("WARNING", logger="graphrunner.checks.padding"):
        _runner(step).capture()
    assert "changed between two identical calls" in caplog.text


def test_stateful_and_leaking_outputs_are_told_apart():
    """A dict output with a state-dependent part and a padding sum: only the sum is reported."""
    counter = torch.zeros(())

    def step(h):
        counter.add_(1)
        return {"rows": h * 2 + counter, "total": h.sum()}

    with pytest.raises(gr.PaddingLeakError, match=r"output\['total'\]") as info:
        _runner(step).capture()
    assert "output['rows']" not in str(info.value)


def test_multi_dim_leak_in_one_dim_is_caught_and_control():
    def verify(ids, hidden):
        h = torch.tanh(hidden + 0.5 + ids[..., None].float())
        return {"logits": h, "state": h.sum(1)}  # a sum over the draft dim: padding drafts leak

    def build(**kw):
        return gr.GraphRunner(
            verify,
            inputs={
                "ids": gr.BatchInput(dtype=torch.long, pad=0, dims=("reqs", "draft")),
                "hidden": gr.BatchInput(trailing=(H,), pad=0.0, dims=("reqs", "draft")),
            },
            buckets={"reqs": [1, 2, 4], "draft": [1, 2, 4]},
            outputs={"logits": ("reqs", "draft"), "state": ("reqs",)},
            device="tape",
            progress=False,
            **kw,
        )

    with pytest.raises(gr.PaddingLeakError) as ei:
        build().capture()
    assert "output['state']" in str(ei.value) and "key (4, 4)" in str(ei.value)
    assert "output['logits']" not in str(ei.value)

    r = build(checks=("drift", "fingerprint"))
    r.capture()
    ids, hid = torch.zeros(3, 3, dtype=torch.long), torch.randn(3, 3, H)
    out = r(ids=ids, hidden=hid)
    ref = verify(ids, hid)
    torch.testing.assert_close(out["logits"], ref["logits"])
    assert (out["state"] - ref["state"]).abs().max() > 0.1  # silently wrong


def test_multi_dim_row_independent_passes():
    def verify(ids, hidden, ctx):
        h = torch.tanh(hidden + ctx[:, None, :] + ids[..., None].float())
        return {"logits": h * 3, "state": h[:, 0]}

    r = gr.GraphRunner(
        verify,
        inputs={
            "ids": gr.BatchInput(dtype=torch.long, pad=0, dims=("reqs", "draft")),
            "hidden": gr.BatchInput(trailing=(H,), pad=0.0, dims=("reqs", "draft")),
            "ctx": gr.BatchInput(trailing=(H,), pad=0.0, dims=("reqs",)),
        },
        buckets={"reqs": [1, 2, 4], "draft": [1, 2, 4]},
        outputs={"logits": ("reqs", "draft"), "state": ("reqs",)},
        device="tape",
        progress=False,
    )
    rep = r.capture()
    assert rep.bucket((4, 4)).info["leak_check_sizes"] == [3, 3]
    ids, hid, ctx = torch.zeros(3, 2, dtype=torch.long), torch.randn(3, 2, H), torch.randn(3, H)
    out = r(ids=ids, hidden=hid, ctx=ctx)
    ref = verify(ids, hid, ctx)
    torch.testing.assert_close(out["logits"], ref["logits"])
    torch.testing.assert_close(out["state"], ref["state"])


def test_check_sizes_follow_the_key_choice():
    grid = KeySpace({"reqs": [1, 2, 4, 8], "draft": [1, 2, 4]})
    assert check_sizes(grid, (8, 4)) == (5, 3)
    assert check_sizes(grid, (1, 1)) is None and check_sizes(grid, (2, 1)) is None
    listed = KeySpace({"reqs": [1, 2, 4, 8], "draft": [1, 2, 4]}, [(8, 4), (4, 4), (8, 1), (2, 2), (1, 1)])
    for k in listed.keys:
        s = check_sizes(listed, k)
        if s is not None:
            assert listed.choose(s)[0] == k and s != k  # a smaller call that really replays k
    assert check_sizes(listed, (2, 2)) == (1, 2)  # (1, 2) is not captured: it replays (2, 2)
    ratio = KeySpace([1, 2, 4, 8], None, 0.25)
    assert check_sizes(ratio, (8,)) == (6,)  # 5 would pad more than 25%: it falls back


def test_only_unbounded_integer_inputs_run_no_forward_and_bounds_make_it_check(caplog):
    """Integer inputs without bounds keep the pad in their real cells, and with no floating-point
    input there is nothing to vary: the check warns and runs no forward. Control: the same step with
    ``bounds=`` runs its forwards and catches the leak (a sum over the padded batch)."""
    table = torch.randn(10, 3)

    def step(ids):
        return table[ids] + table[ids].sum(0)  # the sum reads the padding rows

    def runner(bounds):
        return gr.GraphRunner(
            step,
            inputs={"ids": gr.BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=bounds)},
            buckets=[1, 4],
            device="tape",
            progress=False,
        )

    with caplog.at_level("WARNING", logger="graphrunner.checks.padding"):
        rep = runner(None).capture()
    assert "have no BatchInput(bounds=" in caplog.text
    assert rep.buckets[0].bucket == 4 and rep.buckets[0].info["leak_check_forwards"] == 0
    with pytest.raises(gr.PaddingLeakError, match="bucket 4"):
        runner((0, 9)).capture()
