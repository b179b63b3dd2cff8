"""gr.hf.DecodeRunner.generate as a drop-in for model.generate: its arguments, processors and defaults.

Every comparison is token for token against ``model.generate(...,
cache_implementation="static")`` with the same arguments (sampling: the
runner's generator at model.generate's ``torch.manual_seed``). The logits
processors are transformers' own, built by transformers' own
``_get_logits_processor`` (:mod:`graphrunner.hf.generation`); each case
has a control showing that the argument changed the tokens, so an equality
is not two runs that both ignored it. Tiny random-weight models
(``graphrunner_tools.models.hf_tiny``); nothing is downloaded.
"""

import io
import sys

import pytest
from extras_util import require

transformers = require("transformers")

import torch  # noqa: E402

import graphrunner as gr  # noqa: E402
from graphrunner.hf.generation import GenerationSetup, resolve  # noqa: E402
from graphrunner_tools.models.hf_tiny import build_tiny  # noqa: E402

pytestmark = [
    pytest.mark.hf,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

VOCAB = 128
BUCKETS = [1, 2, 4]

#: the architectures whose default generation_config asked for processors DecodeRunner used to refuse
#: (forced_eos_token_id: the BART family; encoder_no_repeat_ngram_size: blenderbot; begin_suppress_tokens: whisper)
REFUSED_BEFORE = ["bart", "blenderbot", "blenderbot-small", "marian", "mbart", "pegasus", "plbart", "whisper"]


def prompts(batch: int, seed: int, length: int = 5) -> torch.Tensor:
    # ids >= 3: no bos/eos/pad id of any tiny config in the prompt
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference(model, ids, mask=None, seed=None, **kwargs):
    """model.generate with a static cache (and ``torch.manual_seed(seed)`` first when sampling)."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids) if mask is None else mask, cache_implementation="static", **kwargs
        )


def ours(runner, ids, mask=None, seed=None, **kwargs):
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return runner.generate(ids, attention_mask=mask, generator=gen, **kwargs)


def runner_for(model, max_cache_len=16, **kwargs):
    return gr.hf.DecodeRunner(model, max_batch=4, max_cache_len=max_cache_len, buckets=BUCKETS, **kwargs)


# ---------------------------------------------------------------- the eight architectures


@pytest.mark.parametrize("arch", REFUSED_BEFORE)
def test_architectures_refused_before_equal_model_generate(arch):
    """Their own generation_config, untouched: greedy at batch 1 and 3 (padded bucket 4), seeded sampling at batch 3
    (transformers' global top_k=50 default included), every token equal to model.generate's."""
    model = build_tiny(arch)
    gc = model.generation_config
    runner = runner_for(model)
    for batch in (1, 3):
        ids = prompts(batch, seed=batch)
        got, want = ours(runner, ids, max_new_tokens=8), reference(model, ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(got, want), f"{arch} greedy batch {batch}:\n{got}\n{want}"
        if gc.forced_eos_token_id is not None:  # the processor is visible: the last token is the forced EOS
            assert (got[:, -1] == gc.forced_eos_token_id).all()
    ids = prompts(3, seed=7)
    got = ours(runner, ids, seed=11, max_new_tokens=8, do_sample=True)
    want = reference(model, ids, seed=11, max_new_tokens=8, do_sample=True)
    assert torch.equal(got, want), f"{arch} sampled:\n{got}\n{want}"
    assert not torch.equal(ours(runner, ids, seed=12, max_new_tokens=8, do_sample=True), want)  # another seed
    assert runner.stats.eager_steps == 0 and runner.stats.replays == 7 * 4


def test_negative_control_without_the_processors_bart_differs(monkeypatch):
    """With the processors dropped (raw argmax), BART's forced EOS is gone: the test above would see it."""
    model = build_tiny("bart")
    runner = runner_for(model)
    ids = prompts(3, seed=3)
    want = reference(model, ids, max_new_tokens=8, do_sample=False)
    raw = GenerationSetup.next_tokens

    def unprocessed(self, tokens, logits, generator=None):
        self.processors = transformers.LogitsProcessorList()
        return raw(self, tokens, logits, generator)

    monkeypatch.setattr(GenerationSetup, "next_tokens", unprocessed)
    got = ours(runner, ids, max_new_tokens=8)
    assert not torch.equal(got, want)
    assert torch.equal(got[:, :-1], want[:, :-1]) and not (got[:, -1] == 2).all()  # only the forced last token


# ---------------------------------------------------------------- llama with processors


@pytest.fixture(scope="module")
def llama():
    model = build_tiny("llama")
    return model, runner_for(model, max_cache_len=32)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"repetition_penalty": 1.5},
        {"no_repeat_ngram_size": 2},
        {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3},
    ],
    ids=["repetition_penalty", "no_repeat_ngram_size", "both"],
)
def test_llama_repetition_penalty_and_no_repeat_ngram_size(llama, kwargs):
    """Greedy and seeded sampling, equal-length and left-padded prompts (the penalty ignores the pad slots, as
    model.generate's does): equal to model.generate; control: without the arguments the greedy tokens differ."""
    model, runner = llama
    ids = prompts(3, seed=21)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    for m in (None, mask):
        got = ours(runner, ids, m, max_new_tokens=12, pad_token_id=0, **kwargs)
        want = reference(model, ids, m, max_new_tokens=12, do_sample=False, pad_token_id=0, **kwargs)
        assert torch.equal(got, want), f"{kwargs} mask={m is not None}:\n{got}\n{want}"
        assert not torch.equal(got, reference(model, ids, m, max_new_tokens=12, do_sample=False, pad_token_id=0))
    got = ours(runner, ids, seed=5, max_new_tokens=12, do_sample=True, **kwargs)
    assert torch.equal(got, reference(model, ids, seed=5, max_new_tokens=12, do_sample=True, **kwargs))


def _first_tokens(model, ids, n=6):
    return reference(model, ids, max_new_tokens=n, do_sample=False)[:, ids.shape[1] :]


def test_llama_more_processors_equal_model_generate(llama):
    """The rest of transformers' processors, one call each, greedy unless sampling is asked; each changes the
    tokens of the plain greedy decode (the control), and each equals model.generate."""
    model, runner = llama
    ids = prompts(2, seed=4)
    plain = _first_tokens(model, ids)
    first, second = int(plain[0, 0]), int(plain[0, 1])
    cases = [
        {"bad_words_ids": [[first]]},
        {"suppress_tokens": [first, second]},
        {"begin_suppress_tokens": [first]},
        {"sequence_bias": {(first,): -100.0}},
        {"forced_bos_token_id": 7},  # the first new token of a 1-token prompt (below)
        {"forced_eos_token_id": 9},
        {"min_new_tokens": 5, "eos_token_id": second},
        {"exponential_decay_length_penalty": (1, 10.0), "eos_token_id": 9},
        {"do_sample": True, "min_p": 0.2},
        {"do_sample": True, "typical_p": 0.5},
        {"do_sample": True, "top_k": 3, "temperature": 0.5},
        {"do_sample": True, "epsilon_cutoff": 0.02},
    ]
    for kwargs in cases:
        seed = 3 if kwargs.get("do_sample") else None
        x = ids[:, :1] if "forced_bos_token_id" in kwargs else ids
        got = ours(runner, x, seed=seed, max_new_tokens=6, **kwargs)
        want = reference(model, x, seed=seed, max_new_tokens=6, **{"do_sample": False, **kwargs})
        assert torch.equal(got, want), f"{kwargs}:\n{got}\n{want}"
        if not kwargs.get("do_sample"):
            control = plain if x is ids else _first_tokens(model, x)
            assert not torch.equal(got[:, x.shape[1] :], control), f"{kwargs} changed nothing: a weak case"


def test_eos_and_pad_ids_as_arguments(llama):
    """eos_token_id (an int or a list) and pad_token_id override the model's: a row that meets an EOS id continues
    with the pad id, decoding stops when every row has; min_new_tokens holds the EOS back."""
    model, runner = llama
    ids = prompts(3, seed=8)
    plain = _first_tokens(model, ids, n=10)
    eos = int(plain[1, 2])  # row 1 meets it at its third new token
    for kwargs in (
        {"eos_token_id": eos, "pad_token_id": 0},
        {"eos_token_id": [127, eos], "pad_token_id": 0},
        {"eos_token_id": eos, "pad_token_id": 0, "min_new_tokens": 6},
    ):
        got = ours(runner, ids, max_new_tokens=10, **kwargs)
        want = reference(model, ids, max_new_tokens=10, do_sample=False, **kwargs)
        assert torch.equal(got, want), f"{kwargs}:\n{got}\n{want}"
        new = got[1, 5:].tolist()
        if "min_new_tokens" in kwargs:
            assert eos not in new[:6]
        else:
            stop = new.index(eos)
            assert stop <= 2 and all(t == 0 for t in new[stop + 1 :])  # finished: padded with pad_token_id=0


def test_an_eos_criterion_without_a_pad_id_is_refused_before_decoding():
    """A caller's EOS stopping criterion with no pad id anywhere (nor an EOS id to pad with): the rows that finish
    first have nothing to continue with. model.generate fails mid-decode (a TypeError: None * tensor); generate
    refuses it up front naming pad_token_id (mypy found the None). Control: with pad_token_id= it decodes as
    model.generate does."""
    model = build_tiny("llama")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    runner = runner_for(model)
    ids = prompts(2, seed=3)
    crit = transformers.StoppingCriteriaList([transformers.generation.stopping_criteria.EosTokenCriteria(5)])
    with pytest.raises(TypeError):
        reference(model, ids, max_new_tokens=4, do_sample=False, stopping_criteria=crit)
    with pytest.raises(ValueError, match="pad_token_id"):
        ours(runner, ids, max_new_tokens=4, stopping_criteria=crit)
    crit = transformers.StoppingCriteriaList([transformers.generation.stopping_criteria.EosTokenCriteria(5)])
    want = reference(model, ids, max_new_tokens=4, do_sample=False, stopping_criteria=crit, pad_token_id=0)
    assert torch.equal(ours(runner, ids, max_new_tokens=4, stopping_criteria=crit, pad_token_id=0), want)


def test_max_length_defaults_as_model_generate(llama):
    """No max_new_tokens: transformers' global max_length=20 (20 new tokens); max_length= counts the prompt."""
    model, runner = llama
    ids = prompts(1, seed=2)
    got = runner.generate(ids)
    assert got.shape[1] == 5 + 20 and torch.equal(got, reference(model, ids))
    assert torch.equal(runner.generate(ids, max_length=9), reference(model, ids, max_length=9))
    with pytest.raises(ValueError, match="max_cache_len 32"):
        runner.generate(ids, max_new_tokens=40)
    config = transformers.GenerationConfig(max_new_tokens=3, do_sample=False)
    assert torch.equal(runner.generate(ids, config), reference(model, ids, generation_config=config))


def test_sampling_defaults_resolve_as_model_generate(llama):
    """The model's generation_config leaves top_k unset: model.generate fills in transformers' global top_k=50
    (vocab 128, so it matters). Control: the whole vocabulary (top_k=0, the old behaviour) draws other tokens."""
    model, runner = llama
    assert model.generation_config.top_k is None
    ids = prompts(3, seed=9)
    setup = resolve(model, ids, None, kwargs={"do_sample": True, "max_new_tokens": 4})
    assert [(type(p).__name__, getattr(p, "top_k", None)) for p in setup.processors] == [("TopKLogitsWarper", 50)]
    got = ours(runner, ids, seed=13, max_new_tokens=10, do_sample=True)
    assert torch.equal(got, reference(model, ids, seed=13, max_new_tokens=10, do_sample=True))
    assert not torch.equal(got, ours(runner, ids, seed=13, max_new_tokens=10, do_sample=True, top_k=0))
    # the model's generation_config is read at every call, as model.generate reads it
    model.generation_config.do_sample, model.generation_config.top_k = True, 5
    try:
        assert torch.equal(
            ours(runner, ids, seed=13, max_new_tokens=6), reference(model, ids, seed=13, max_new_tokens=6)
        )
    finally:
        model.generation_config.do_sample, model.generation_config.top_k = False, None


class _Recorder:
    """A streamer recording what it is given (transformers' BaseStreamer protocol: put, end)."""

    def __init__(self):
        self.items, self.ended = [], 0

    def put(self, value):
        self.items.append(value.tolist())

    def end(self):
        self.ended += 1


def test_streamer_custom_processors_and_criteria(llama):
    """A streamer gets the prompt, then each step's tokens, then end(), as from model.generate; a caller's
    logits_processor, stopping_criteria and prefix_allowed_tokens_fn apply as there."""
    model, runner = llama
    ids = prompts(1, seed=6)
    mine, theirs = _Recorder(), _Recorder()
    got = runner.generate(ids, max_new_tokens=5, streamer=mine)
    want = reference(model, ids, max_new_tokens=5, do_sample=False, streamer=theirs)
    assert torch.equal(got, want) and mine.items == theirs.items and mine.ended == theirs.ended == 1
    assert len(mine.items) == 1 + 5

    class Ban(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.index_fill(1, torch.tensor([int(want[0, 5])]), -float("inf"))

    class StopAt(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 8, dtype=torch.bool)

    def allowed(batch_id, sent):
        return list(range(3, 60))

    kw = dict(
        max_new_tokens=6,
        logits_processor=transformers.LogitsProcessorList([Ban()]),
        stopping_criteria=transformers.StoppingCriteriaList([StopAt()]),
        prefix_allowed_tokens_fn=allowed,
    )
    got = runner.generate(ids, **kw)
    assert got.shape[1] == 8 and got[0, 5] != want[0, 5] and bool((got[0, 5:] < 60).all())
    assert torch.equal(got, reference(model, ids, do_sample=False, **kw))


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_beams": 2}, r"beam_search \(num_beams=2\).*num_beams=1"),
        (
            {"num_return_sequences": 2, "do_sample": True},
            r"num_return_sequences=2 \(passed to generate\).*repeat_interleave",
        ),
        ({"return_dict_in_generate": True, "output_scores": True}, "return_dict_in_generate=True.*token tensor only"),
        ({"guidance_scale": 1.5}, "guidance_scale=1.5.*unconditional forward"),
        ({"penalty_alpha": 0.6, "top_k": 4}, r"contrastive_search.*penalty_alpha=0.6"),
        ({"cache_implementation": "dynamic"}, "cache_implementation='dynamic'.*own StaticCache"),
        ({"past_key_values": object()}, r"does not take past_key_values=.*only input_ids and attention_mask"),
        ({"max_new_token": 3}, r"does not take max_new_token=.*check the spelling"),
        ({"synced_gpus": True}, "synced_gpus=True"),
        ({"assistant_model": "m"}, "assistant_model='m'.*assisted decoding"),
        (
            {"negative_prompt_ids": torch.ones((1, 2), dtype=torch.long)},
            r"negative_prompt_ids=<tensor of shape \[1, 2\]>",
        ),
    ],
)
def test_unsupported_arguments_are_refused_by_name(llama, kwargs, match):
    """Refused before anything runs, naming the argument and what to do instead."""
    _, runner = llama
    with pytest.raises(ValueError, match=match):
        runner.generate(prompts(1, seed=0), **{"max_new_tokens": 2, **kwargs})


def test_a_generation_config_asking_for_beams_is_refused_naming_its_source():
    model = build_tiny("llama")
    model.generation_config.num_beams = 4
    runner = runner_for(model)
    with pytest.raises(ValueError, match=r"beam_search \(num_beams=4\)"):
        runner.generate(prompts(1, seed=0), max_new_tokens=2)
    model.generation_config.num_beams = 1
    model.generation_config.do_sample, model.generation_config.num_return_sequences = True, 2
    with pytest.raises(ValueError, match=r"num_return_sequences=2 \(from the model's generation_config\)"):
        runner.generate(prompts(1, seed=0), max_new_tokens=2)
    assert not runner.runner.captured  # refused before the capture
    model.generation_config.do_sample, model.generation_config.num_return_sequences = False, 1
    ids = prompts(1, seed=0)
    assert torch.equal(runner.generate(ids, max_new_tokens=2), reference(model, ids, max_new_tokens=2))


def test_a_model_in_train_mode_is_refused_saying_so():
    model = build_tiny("llama", attention_dropout=0.1).train()
    with pytest.raises(ValueError, match=r"in train\(\) mode.*call model.eval\(\)"):
        runner_for(model)
    runner = runner_for(model.eval())
    ids = prompts(2, seed=1)
    assert torch.equal(runner.generate(ids, max_new_tokens=3), reference(model, ids, max_new_tokens=3))
    model.train()  # after capture: model.generate would now drop out at random; the graphs would not
    with pytest.raises(ValueError, match=r"in train\(\) mode"):
        runner.generate(ids, max_new_tokens=3)
    model.eval()
    assert torch.equal(runner.generate(ids, max_new_tokens=3), reference(model, ids, max_new_tokens=3))


# ---------------------------------------------------------------- progress and report


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize(
    "stream,progress,shown",
    [(_Terminal, True, True), (_Terminal, False, False), (io.StringIO, True, False)],
    ids=["terminal", "terminal-progress-off", "pipe"],
)
def test_progress_bars_on_a_terminal_only(monkeypatch, stream, progress, shown):
    err = stream()
    monkeypatch.setattr(sys, "stderr", err)
    runner = gr.hf.DecodeRunner(build_tiny("llama"), max_batch=2, max_cache_len=16, buckets=[1, 2], progress=progress)
    runner.capture()
    text = err.getvalue()
    assert ("graphrunner capture" in text and "gr.hf self-test" in text) is shown, text
    if not shown:
        assert text == ""


def test_the_capture_report_shows_the_self_test_time():
    model = build_tiny("llama")
    report = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=16, buckets=[1, 2]).capture()
    (step,) = report.after_capture
    assert step["name"] == "self-test" and step["seconds"] > 0
    assert step["summary"].startswith("batches 1, 2 x 3 decode steps vs eager")
    assert f"after capture: self-test {step['seconds']:.3f}s (batches 1, 2" in report.table()
    assert report.to_dict()["after_capture"] == [step]
    bare = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=16, buckets=[1, 2], self_test=False).capture()
    assert bare.after_capture == [] and "after capture" not in bare.table()


def test_too_many_rows_names_the_batch_and_what_to_change(llama):
    """Issue 42 item 8: 6 rows on a max_batch=4 runner names the 6 rows and both fixes (it said only
    "need 1 <= batch <= max_batch=4")."""
    _, runner = llama
    with pytest.raises(ValueError) as ei:
        ours(runner, prompts(6, seed=1), max_new_tokens=2)
    msg = str(ei.value)
    assert "6 rows" in msg and "max_batch=4" in msg
    assert "DecodeRunner(model, max_batch=6" in msg and "input_ids[:4]" in msg
    with pytest.raises(ValueError, match="at least one row"):
        ours(runner, torch.zeros((0, 5), dtype=torch.long), max_new_tokens=2)
