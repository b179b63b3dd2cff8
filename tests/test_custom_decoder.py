"""examples/custom_decoder.py (docs/tutorial.md): your own decoder with a slot-indexed KV cache
and a scratch padding slot, served through GraphRunner and checked against eager twins.

The reference is independent of the graph: the same model and weights run eagerly, once on the
padded batch of every step (bit for bit) and once as an engine that never pads (same tokens).
The negative control breaks the padding rule (padding rows in slot 0, a real request's slot)
and shows a real request's tokens change, although every step still equals eager on the
padded batch: only the unpadded comparison sees the rule broken.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import graphrunner as gr

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_decoder.py"


def _load_example():
    name = "graphrunner_example_custom_decoder"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


ex = _load_example()
NO_PADDING_CHECK = ("drift", "fingerprint")


@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_tokens_equal_the_eager_twin(backend):
    res = ex.run(backend, device="tape")
    requests = ex.make_requests()
    assert [len(t) for t in res.eager_tokens] == [n for _, n in requests]
    assert res.graph_tokens == res.eager_tokens  # token for token, every request
    assert res.padded_equal == res.steps  # torch.equal on the padded batch, every step
    assert res.max_real_diff < 1e-4  # real rows against the unpadded engine
    assert res.padded_steps >= 5  # padding really happened ...
    assert all(res.replays[b] > 0 for b in ex.BUCKETS)  # ... and every bucket was replayed
    assert res.ok and res.summary().endswith("OK")


def test_padding_rows_in_a_real_slot_change_a_real_request():
    """Negative control of the scratch-slot rule: padding rows pointed at slot 0 (request 0's
    slot) overwrite its first key/value, and its tokens change. The graph still equals eager
    on the same padded batch at every step: that comparison cannot see a broken padding rule."""
    res = ex.run("breakable", pad_slot=0, device="tape", checks=NO_PADDING_CHECK)
    assert res.graph_tokens != res.eager_tokens
    assert res.graph_tokens[0] != res.eager_tokens[0]  # request 0 owns slot 0 from the first step
    assert res.padded_equal == res.steps
    assert res.max_real_diff > 1e-2
    assert not res.ok and res.summary().endswith("MISMATCH")


@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_the_padding_check_refuses_padding_rows_in_a_real_slot(backend):
    """What the example's --pad-slot 0 says: the default checks refuse the capture. The padding check's
    call sequences see the request in slot 0 read, at its next call, the key/value the padding rows
    wrote at position 0 of slot 0 (also when the warmups left the same values there). The negative
    control is test_padding_rows_in_a_real_slot_change_a_real_request (the check off: tokens change)."""
    attention = "masked" if backend == "full" else "varlen"
    with pytest.raises(gr.PaddingLeakError) as info:
        ex.make_runner(ex.TinyDecoder(attention), backend, pad_slot=0, device="tape").capture()
    msg = str(info.value)
    assert "in a call after a padded call" in msg
    assert "slots (pad 0, also a real value: bounds (0, 7))" in msg
    assert "TinyDecoder.k_cache[:, 0, :, 0, :]" in msg and "TinyDecoder.v_cache[:, 0, :, 0, :]" in msg


def test_capture_writes_only_the_scratch_slot():
    """With the scratch slot as the pad, capture (warmups, padding check, capture) leaves every
    request slot as it found it: no cache reset is needed before serving. Control: with slot 0
    as the pad, capture writes slot 0."""
    model = ex.TinyDecoder("masked")
    ex.make_runner(model, "full", device="tape").capture()
    assert not model.k_cache[:, : ex.NUM_SLOTS].any() and not model.v_cache[:, : ex.NUM_SLOTS].any()
    assert model.k_cache[:, ex.SCRATCH].any()

    bad = ex.TinyDecoder("masked")
    ex.make_runner(bad, "full", pad_slot=0, device="tape", checks=NO_PADDING_CHECK).capture()
    assert bad.k_cache[:, 0].any()


def test_full_graph_refuses_the_varlen_break():
    """A full graph has no eager breaks: the host read in varlen_attention is refused at
    capture, naming the line; the masked attention captures (test above)."""
    with pytest.raises(gr.CaptureError, match=r"int\(positions.max\(\)\)"):
        ex.make_runner(ex.TinyDecoder("varlen"), "full", device="tape").capture()


def test_bounds_are_checked_in_debug_mode():
    """Bounds say which values are real: in debug mode the scratch slot passed as a request's
    slot is refused before anything is written; without debug mode it is not checked."""
    ids, pos = torch.tensor([1, 2]), torch.tensor([0, 0])
    runner = ex.make_runner(ex.TinyDecoder(), device="tape", debug=True)
    runner.capture()
    with pytest.raises(ValueError, match=r"input 'slots' row 1 holds 8"):
        runner(input_ids=ids, positions=pos, slots=torch.tensor([0, ex.SCRATCH]))
    quiet = ex.make_runner(ex.TinyDecoder(), device="tape")
    quiet.capture()
    assert quiet(input_ids=ids, positions=pos, slots=torch.tensor([0, ex.SCRATCH])).shape == (2, ex.VOCAB)


def test_main_exit_codes(capsys):
    assert ex.main(["--backend", "breakable", "--device", "tape", "--requests", "4"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")
    assert ex.main(["--backend", "breakable", "--device", "tape", "--pad-slot", "0"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        ex.main(["--pad-slot", "9"])
    assert exc.value.code == 2
