"""The `model.generate` contract: `spec.generate` gives what `model.generate` gives, for the same arguments.

A grid of generation arguments (no `max_new_tokens`, `max_length`,
`min_length`, `min_new_tokens`, explicit `None`s, EOS as an int, a list or a
tensor, `GenerationConfig` objects, `stop_strings` with a tokenizer,
`max_time`, `return_dict_in_generate`) runs through both, on a tiny model of
every architecture, greedy; the outputs and the length warnings must be identical.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import GenerationConfig, PreTrainedTokenizerFast

import selfspec
from selfspec.testing import COMMON, TINY_CONFIGS, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)
LETTERS = "abcdefghij"
# The tiny vocabulary as words: token i is two letters, so a stop string can span two tokens.
WORDS = [LETTERS[i // 10] + LETTERS[i % 10] for i in range(COMMON["vocab_size"])]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer over the tiny models' 97 tokens, built locally (no hub): BPE merging letter pairs.

    Token i is the two letters WORDS[i]; the single letters (ids 97..106) exist only so that any text
    can be tokenized, which StopStringCriteria needs. Tokens decode by concatenation.
    """
    vocab = {w: i for i, w in enumerate(WORDS)} | {c: len(WORDS) + i for i, c in enumerate(LETTERS)}
    backend = Tokenizer(models.BPE(vocab, [(w[0], w[1]) for w in WORDS]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


TOKENIZER = tiny_tokenizer()


def grid(new: list[int]) -> dict[str, dict]:
    """Argument sets; `new` is the model's own greedy continuation, so the EOS and stop strings occur in it."""
    eos, later = new[6], new[9]
    spanning = WORDS[new[4]][1] + WORDS[new[5]]  # a stop string across two tokens
    return {
        "no length at all (20 new tokens)": {},
        "max_length": dict(max_length=14),
        "max_length and max_new_tokens": dict(max_length=9, max_new_tokens=12),
        "min_length holds EOS back": dict(min_length=15, max_new_tokens=14, eos_token_id=eos),
        "min_new_tokens holds EOS back": dict(min_new_tokens=10, max_new_tokens=14, eos_token_id=eos),
        "explicit Nones": dict(max_new_tokens=None, eos_token_id=None, top_k=None, temperature=None),
        "eos int": dict(eos_token_id=eos, max_new_tokens=30),
        "eos list": dict(eos_token_id=[later, eos], max_new_tokens=30),
        "eos 0-d tensor": dict(eos_token_id=torch.tensor(eos), max_new_tokens=30),
        "eos 1-d tensor": dict(eos_token_id=torch.tensor([later, eos]), max_new_tokens=30),
        "generation_config": dict(generation_config=GenerationConfig(max_new_tokens=11, eos_token_id=later)),
        "generation_config, eos tensor": dict(
            generation_config=GenerationConfig(max_length=30, eos_token_id=torch.tensor([eos]))
        ),
        "generation_config without a length": dict(generation_config=GenerationConfig(do_sample=False)),
        "stop_strings": dict(stop_strings=[spanning], tokenizer=TOKENIZER, max_new_tokens=30),
        "stop_strings, one token": dict(stop_strings=WORDS[later], tokenizer=TOKENIZER, max_new_tokens=30),
        "max_time, large": dict(max_time=1e6, max_new_tokens=12),
        "repetition_penalty": dict(repetition_penalty=1.3, max_new_tokens=16),
    }


@contextlib.contextmanager
def model_eos(model, eos):
    """The model's own generation_config names `eos` as EOS for the block (the tiny models have none)."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def run(fn, prompt, kwargs):
    """Output and the length warnings of one generate call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(prompt, **kwargs)
    return out, sorted({str(w.message) for w in caught if "length" in str(w.message)})


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_contract(arch):
    model = tiny_model(arch)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(layers=[0, 1, 3], draft_length=3))
    prompt = random_prompt(5, seed=3)
    new = model.generate(prompt, max_new_tokens=30)[0, prompt.shape[1] :].tolist()
    for name, kwargs in grid(new).items():
        ref, ref_warnings = run(model.generate, prompt, kwargs)
        out, out_warnings = run(spec.generate, prompt, kwargs)
        assert torch.equal(out, ref), f"{arch}, {name}: selfspec {out[0].tolist()} != generate {ref[0].tolist()}"
        assert out.dtype == ref.dtype and out_warnings == ref_warnings, (arch, name, out_warnings, ref_warnings)

    # The model's own EOS occurs in its output: an explicit eos_token_id=None disables it, as in transformers.
    with model_eos(model, new[3]):
        for kwargs in (dict(max_new_tokens=20), dict(max_new_tokens=20, eos_token_id=None)):
            ref, out = model.generate(prompt, **kwargs), spec.generate(prompt, **kwargs)
            assert torch.equal(out, ref), (arch, kwargs, out[0].tolist(), ref[0].tolist())
        assert spec.generate(prompt, max_new_tokens=20, eos_token_id=None).shape[1] == prompt.shape[1] + 20

    result = spec.generate(prompt, max_new_tokens=6, return_dict_in_generate=True)
    expected = model.generate(prompt, max_new_tokens=6, return_dict_in_generate=True)
    assert type(result) is type(expected) and torch.equal(result.sequences, expected.sequences)


def test_long_prompt_without_max_new_tokens_gets_20_new_tokens():
    """A prompt of 20+ tokens with no length argument: 20 new tokens (selfspec once read max_length=20 as a total)."""
    model = tiny_model("llama")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2))
    for length in (5, 30, 250):  # 250: capped by the context of 256, as transformers caps it
        prompt = random_prompt(length, seed=length)
        ref, ref_warnings = run(model.generate, prompt, {})
        out, out_warnings = run(spec.generate, prompt, {})
        assert torch.equal(out, ref) and out.shape[1] == min(length + 20, 256)
        assert out_warnings == ref_warnings


def test_explicit_max_length_none_means_the_default():
    """transformers 5.24 raises TypeError (None + int) here; selfspec takes the default it stands for."""
    model = tiny_model("llama")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2))
    prompt = random_prompt(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(spec.generate(prompt, max_length=None), model.generate(prompt))


def test_max_time_stops_generation():
    model = tiny_model("llama")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2))
    out = spec.generate(random_prompt(5), max_new_tokens=200, max_time=0.0)
    assert out.shape[1] < 5 + 200  # stopped by time, after the first chunk


EOS_PROBES = {"None": None, "[]": [], "int": 5, "list": [5, 6], "0-d tensor": torch.tensor(5),
              "1-d tensor": torch.tensor([5])}


@contextlib.contextmanager
def transformers_warnings():
    """The messages transformers logs in the block (its logger does not propagate to the root)."""
    import logging

    caught: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            caught.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield caught
    finally:
        logger.removeHandler(handler)


def test_an_eos_that_leaves_out_the_pad_id_hides_the_pad_tokens_as_model_generate_does():
    """No attention_mask and a pad id that is not an EOS id: transformers infers `ids != pad` and hides those tokens."""
    import copy

    model = copy.deepcopy(tiny_model("llama"))
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = 2  # as SmolLM2: pad = EOS = 2
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(layers=[0, 1, 3], draft_length=3))
    prompt = random_prompt(12, seed=3)
    prompt[0, 4] = prompt[0, 7] = 2  # the pad id inside the prompt (as a chat template puts it)
    left = prompt.clone()
    left[0, :2] = 2  # and as left padding
    for name, eos in EOS_PROBES.items():
        for ids in (prompt, left):
            ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos)
            out = spec.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos)
            assert torch.equal(out, ref), (name, ids[0].tolist(), out[0].tolist(), ref[0].tolist())
    # The model's own EOS includes the pad id: nothing is hidden, the pad tokens are attended to.
    attended = spec.generate(prompt, max_new_tokens=12)
    assert torch.equal(attended, model.generate(prompt, max_new_tokens=12))
    assert not torch.equal(attended, spec.generate(prompt, max_new_tokens=12, eos_token_id=5))
    # A batch without a mask: each row's pad tokens hidden alike.
    batch = torch.cat([prompt, random_prompt(12, seed=4)])
    batch[1, 3] = 2
    ref = model.generate(batch, max_new_tokens=8, do_sample=False, eos_token_id=[5])
    assert torch.equal(spec.generate(batch, max_new_tokens=8, do_sample=False, eos_token_id=[5]), ref)
    # A last token that transformers hides has no padded equivalent: refused, naming the way out.
    ends = prompt.clone()
    ends[0, -1] = 2
    with pytest.raises(ValueError, match="ends with the pad token id 2.*attention_mask"):
        spec.generate(ends, max_new_tokens=4, eos_token_id=5)
    mask = torch.ones_like(ends)
    assert torch.equal(spec.generate(ends, attention_mask=mask, max_new_tokens=4, eos_token_id=5),
                       model.generate(ends, attention_mask=mask, max_new_tokens=4, eos_token_id=5))


def test_a_batch_without_a_mask_warns_as_model_generate_warns():
    model = tiny_model("llama")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(exit_layer=2))
    batch = torch.cat([random_prompt(6, seed=1), random_prompt(6, seed=2)])
    for fn in (model.generate, spec.generate):  # the pad id unset: transformers takes EOS's, and warns (each time)
        with transformers_warnings() as caught:
            fn(batch, max_new_tokens=3, eos_token_id=5)
        assert any("attention mask and the pad token id were not set" in m for m in caught), (fn, caught)
    with transformers_warnings() as caught:  # one prompt: nothing to warn about, as in transformers
        spec.generate(batch[:1], max_new_tokens=3, eos_token_id=5)
    assert not caught
