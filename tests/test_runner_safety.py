"""Nothing written before validation, no stale rows after a failed copy, one
call at a time per runner (issue 10, items 3 and 4)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

import graphrunner as gr
from graphrunner.errors import CaptureError, GraphRunnerError
from graphrunner.ownership import CallOwner
from graphrunner.staging import StaticInputs

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import assert_all_ok, run_ranks  # noqa: E402

D = 4
W = torch.randn(D, D, generator=torch.Generator().manual_seed(0))


def _step(x, y):
    return x @ W + y


def _runner(backend="full", step=_step, buckets=(1, 2, 4)):
    r = gr.GraphRunner(
        step,
        {
            "x": gr.BatchInput(trailing=(D,), dtype=torch.float32, pad=0.0),
            "y": gr.BatchInput(trailing=(D,), dtype=torch.float32, pad=0.0),
        },
        buckets=list(buckets),
        backend=backend,
        device="tape",
        progress=False,
    )
    r.capture()
    return r


class FailsToCopy(torch.Tensor):
    """A tensor that passes every check (dtype, shape, memory) but whose
    values cannot be read: copying from it raises, as a device fault would."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ or func is torch._foreach_copy_:
            raise RuntimeError("device lost while reading this tensor")
        return super().__torch_function__(func, types, args, kwargs or {})


def _failing(n):
    return torch.randn(n, D).as_subclass(FailsToCopy)


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize("backend", ["full", "breakable", "eager"])
def test_meta_input_is_rejected_before_any_write(backend):
    r = _runner(backend)
    r(x=torch.ones(4, D), y=torch.ones(4, D))
    before = {k: v.clone() for k, v in r.static_inputs.items()}
    with pytest.raises(ValueError, match="input 'y' is on the meta device"):
        r(x=torch.full((3, D), 7.0), y=torch.empty(3, D, device="meta"))
    for k, v in r.static_inputs.items():
        assert torch.equal(v, before[k]), k  # x was not written either
    x, y = torch.randn(3, D), torch.randn(3, D)
    assert torch.allclose(r(x=x, y=y), _step(x, y), atol=1e-6)  # still usable


def test_input_aliasing_a_static_buffer_is_rejected():
    r = _runner()
    r(x=torch.randn(4, D), y=torch.randn(4, D))
    static = r.static_inputs
    with pytest.raises(ValueError, match="input 'x' aliases the runner's static buffer of input 'y'"):
        r(x=static["y"][:2], y=torch.randn(2, D))
    with pytest.raises(ValueError, match="input 'x' aliases the runner's static buffer of input 'x'"):
        r(x=static["x"][1:3], y=torch.randn(2, D))  # shifted rows of its own buffer
    # Its own rows [0, n) are its current contents: allowed, and computed right.
    x_now, y = static["x"][:2].clone(), torch.randn(2, D)
    assert torch.allclose(r(x=static["x"][:2], y=y), _step(x_now, y), atol=1e-6)


# ------------------------------------------------------- a copy that fails
def _stale_rows_after_failed_copy(r):
    """Serve batch 1, then batch 4 whose second input fails to copy (after the
    first was written), then batch 3 (bucket 4): return row 3 of the static
    ``x``, a padding row of the last call."""
    r(x=torch.randn(1, D), y=torch.randn(1, D))
    with pytest.raises(GraphRunnerError, match=r"copying input 'y' .* failed: RuntimeError: device lost"):
        r(x=torch.full((4, D), 9.0), y=_failing(4))
    x, y = torch.randn(3, D), torch.randn(3, D)
    assert torch.allclose(r(x=x, y=y), _step(x, y), atol=1e-6)
    return r.static_inputs["x"][3]


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_failed_copy_restores_pad_rows(backend):
    r = _runner(backend)
    assert torch.equal(_stale_rows_after_failed_copy(r), torch.zeros(D))  # pad, not the failed call's 9.0


def test_failed_copy_negative_control_stale_rows_without_restore(monkeypatch):
    """With the restore turned off, the failed call's rows stay behind as the
    next call's padding rows (what a KV-cache write of a padding row would
    then read)."""
    monkeypatch.setattr(StaticInputs, "restore_pads", lambda self, extent=None: None)
    r = _runner()
    assert torch.equal(_stale_rows_after_failed_copy(r), torch.full((D,), 9.0))


# ------------------------------------------------------------------ threads
def _blocking_runner():
    """A breakable runner whose eager break blocks while ``gate`` is set."""
    state = {"entered": threading.Event(), "release": threading.Event(), "block": False}

    @gr.no_graph
    def maybe_block(h):
        if state["block"]:
            state["block"] = False
            state["entered"].set()
            assert state["release"].wait(10)
        return h

    def step(x, y):
        return maybe_block(x @ W) + y

    return _runner("breakable", step=step), state


def _call_in_thread(r, x, y, box):
    try:
        box["out"] = r(
            x=x,
            y=y,
        ).clone()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        box["err"] = exc


def _overlapping_calls(r, state):
    """Thread A's call is held inside its eager break while this thread
    calls the same runner; returns (A's result or error, this call's error)."""
    xa, ya = torch.randn(2, D), torch.randn(2, D)
    box: dict = {}
    state["block"] = True
    t = threading.Thread(target=_call_in_thread, args=(r, xa, ya, box), name="caller-A")
    t.start()
    assert state["entered"].wait(10)
    mine = None
    try:
        r(x=torch.randn(2, D) * 5, y=torch.randn(2, D) * 5)
    except GraphRunnerError as exc:
        mine = exc
    state["release"].set()
    t.join(10)
    assert not t.is_alive()
    return box, _step(xa, ya), mine


def test_second_thread_gets_a_clear_error_and_first_call_stays_right():
    r, state = _blocking_runner()
    box, ref, mine = _overlapping_calls(r, state)
    assert mine is not None and "one runner serves one call at a time" in str(mine)
    assert "err" not in box and torch.allclose(box["out"], ref, atol=1e-6)
    x, y = torch.randn(3, D), torch.randn(3, D)
    assert torch.allclose(r(x=x, y=y), _step(x, y), atol=1e-6)  # lock released


def test_threads_negative_control_wrong_result_without_the_check(monkeypatch):
    class NoLock:  # the ownership check turned off: every acquire succeeds
        def acquire(self, blocking=True):
            return True

        def release(self):
            pass

    real_init = CallOwner.__init__

    def init(self):
        real_init(self)
        self.lock = NoLock()

    monkeypatch.setattr(CallOwner, "__init__", init)
    r, state = _blocking_runner()
    box, ref, mine = _overlapping_calls(r, state)
    assert mine is None  # the second call went through ...
    assert not torch.allclose(box["out"], ref, atol=1e-3)  # ... and thread A got a wrong result, silently


def test_separate_runners_in_separate_threads_stay_correct():
    runners = [_runner("breakable"), _runner("full")]
    errors: list = []

    def serve(r, seed):
        g = torch.Generator().manual_seed(seed)
        for i in range(40):
            n = 1 + i % 4
            x, y = torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)
            if not torch.allclose(r(x=x, y=y), _step(x, y), atol=1e-6):
                errors.append((seed, i))

    threads = [threading.Thread(target=serve, args=(r, s)) for s, r in enumerate(runners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and not any(t.is_alive() for t in threads)


def test_call_from_inside_step_is_a_reentrancy_error():
    holder: dict = {}

    @gr.no_graph
    def call_self(h):
        if holder.get("armed"):
            holder["armed"] = False
            holder["runner"](x=torch.ones(1, D), y=torch.ones(1, D))
        return h

    r = _runner("breakable", step=lambda x, y: call_self(x) + y)
    holder.update(runner=r, armed=True)
    with pytest.raises(GraphRunnerError, match="re-entrantly"):
        r(x=torch.ones(2, D), y=torch.ones(2, D))


def test_call_after_cleanup_says_so():
    r = _runner()
    r.cleanup()
    with pytest.raises(CaptureError, match="after cleanup"):
        r(x=torch.ones(1, D), y=torch.ones(1, D))
    fresh = gr.GraphRunner(
        _step,
        {"x": gr.BatchInput(trailing=(D,)), "y": gr.BatchInput(trailing=(D,))},
        buckets=[1],
        device="tape",
        progress=False,
    )
    with pytest.raises(CaptureError, match="before capture"):
        fresh(x=torch.ones(1, D), y=torch.ones(1, D))


# -------------------------------------------------- multi-rank copy failure
def _copy_fails_worker(rank, world):
    import torch.distributed as dist

    from graphrunner.group import TorchDistGroup

    def step(x, y):
        out = x @ W + y
        dist.all_reduce(out)  # a collective inside the captured step
        return out

    r = gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=(D,)), "y": gr.BatchInput(trailing=(D,))},
        buckets=[1, 2, 4],
        backend="full",
        device="tape",
        group=TorchDistGroup(),
        progress=False,
    )
    r.capture()
    x, y = torch.ones(2, D), torch.ones(2, D)
    try:
        r(x=x, y=_failing(2) if rank == 1 else y)
        first = "no error"
    except GraphRunnerError as exc:
        first = str(exc)
    out = r(x=x, y=y).tolist()  # every rank goes on together (a list: tensors do not survive the queue)
    r.cleanup()
    return first, out


@pytest.mark.multirank
def test_rank_whose_copy_fails_makes_every_rank_raise_then_all_continue():
    res = run_ranks(_copy_fails_worker, world_size=2, timeout=90)
    assert_all_ok(res)
    (first0, out0), (first1, out1) = res[0].value, res[1].value
    assert "another rank passed invalid inputs" in first0
    assert "copying input 'y'" in first1 and "device lost" in first1
    ref = (torch.ones(2, D) @ W + 1) * 2  # all_reduce over 2 ranks of the same values
    assert torch.allclose(torch.tensor(out0), ref, atol=1e-5) and torch.allclose(torch.tensor(out1), ref, atol=1e-5)


# ---------------------------------------------------------------- issue 42 item 8: a data-dependent shape, named
def test_boolean_mask_indexing_is_refused_naming_the_op_and_the_line():
    """The output of ``x[mask]`` has a data-dependent shape ([0, 64] at capture): the refusal names the
    op and the step's line (it spoke of the output shape only), and the step's writes are put back."""
    import inspect

    cache = torch.zeros(4)

    def step(x):
        cache.add_(1.0)
        return x[x[:, 0] > 100]  # MASK_LINE

    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(64,))}, [1, 2, 4], device="tape", progress=False)
    with pytest.raises(TypeError) as ei:
        r.capture()
    msg = str(ei.value)
    line = next(
        i
        for i, text in enumerate(inspect.getsource(step).splitlines(), inspect.getsourcelines(step)[1])
        if "MASK_LINE" in text
    )
    assert "has shape [0, 64]" in msg  # what the runner found ...
    assert "boolean-mask indexing" in msg and "aten.index.Tensor" in msg  # ... and the op behind it
    assert f"test_runner_safety.py:{line} in step" in msg and "@no_graph" in msg
    assert torch.equal(cache, torch.zeros(4))  # the check puts back its run (warmup 0), the diagnosis its own


def test_negative_control_without_the_diagnosis_the_message_names_only_the_shape(monkeypatch):
    import graphrunner.capturing as capturing

    monkeypatch.setattr(capturing, "first_unsafe_op", None)

    def step(x):
        return x[x[:, 0] > 100]

    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(64,))}, [1, 2, 4], device="tape", progress=False)
    with pytest.raises(TypeError) as ei:
        r.capture()
    assert "has shape [0, 64]" in str(ei.value) and "aten.index" not in str(ei.value)
