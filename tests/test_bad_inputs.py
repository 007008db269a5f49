"""Every bad input gets a clear error: the right exception type, and a message naming the bad value.

One table per surface: `generate()` arguments, plan dicts and plan files,
artifact files (draft vocabularies, exit heads), model loading. A fuzz test
(hypothesis) over plan dicts and artifact manifests checks the general rule:
any input either loads or raises ValueError with a message, never another
exception type and never a silent coercion.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

import selfspec
from selfspec import loading
from selfspec.head import load_head
from selfspec.testing import make_head, make_vocab, random_prompt, tiny_model
from selfspec.vocab import load_vocab

VOCAB = 97  # the tiny models' vocabulary
CONTEXT = 256  # and their context


@pytest.fixture(scope="module")
def spec():
    return selfspec.wrap(tiny_model("llama", torch.float32), plan=selfspec.DraftPlan(exit_layer=2))


# --------------------------------------------------------------------------- generate()

PROMPT = random_prompt(5)


class NewFieldConfig(GenerationConfig):
    """A GenerationConfig with a field a later transformers might add: selfspec must refuse it, not ignore it."""

    def __init__(self, **kwargs):
        self.speculative_widget = kwargs.pop("speculative_widget", None)
        super().__init__(**kwargs)


def _out_of_vocab():
    ids = PROMPT.clone()
    ids[0, 3] = VOCAB + 3
    return ids


GENERATE_CASES = {
    "float ids": (dict(input_ids=PROMPT.float()), ValueError, ["torch.float32"]),
    "bool ids": (dict(input_ids=PROMPT.bool()), ValueError, ["torch.bool"]),
    "id >= vocab": (dict(input_ids=_out_of_vocab()), ValueError, [f"{VOCAB + 3}", "position 3", f"{VOCAB} tokens"]),
    "negative id": (dict(input_ids=torch.tensor([[4, -1, 5]])), ValueError, ["-1", "position 1", "0..96"]),
    "1-d ids": (dict(input_ids=PROMPT[0]), ValueError, ["1-d"]),
    "ids on the meta device": (dict(input_ids=PROMPT.to("meta")), ValueError, ["meta"]),
    "max_new_tokens 2.5": (dict(max_new_tokens=2.5), ValueError, ["max_new_tokens=2.5"]),
    "max_new_tokens True": (dict(max_new_tokens=True), ValueError, ["max_new_tokens=True"]),
    "max_new_tokens 0": (dict(max_new_tokens=0), ValueError, ["max_new_tokens=0", ">= 1"]),
    "max_new_tokens str": (dict(max_new_tokens="5"), ValueError, ["max_new_tokens='5'"]),
    "min_new_tokens -1": (dict(min_new_tokens=-1, max_new_tokens=4), ValueError, ["min_new_tokens=-1"]),
    "mask of another shape": (dict(attention_mask=torch.ones(1, 3)), ValueError, ["[1, 3]", "[1, 5]"]),
    "mask as a list": (dict(attention_mask=[[1] * 5]), ValueError, ["list"]),
    "mask with right padding": (dict(attention_mask=torch.tensor([[1, 1, 1, 1, 0]])), ValueError,
                                ["row 0", "padding that is not all on the left", "padding_side='left'"]),
    "mask of padding only": (dict(attention_mask=torch.zeros(1, 5, dtype=torch.long)), ValueError, ["no token"]),
    "num_beams": (dict(num_beams=2), ValueError, ["num_beams=2", "not supported"]),
    "num_return_sequences": (dict(num_return_sequences=3, do_sample=True), ValueError, ["num_return_sequences=3"]),
    "output_scores": (dict(output_scores=True), ValueError, ["output_scores=True", "not supported"]),
    "token_healing": (dict(token_healing=True), ValueError, ["token_healing=True"]),
    "prompt_lookup_num_tokens": (dict(prompt_lookup_num_tokens=3), ValueError, ["prompt_lookup_num_tokens=3"]),
    "unsupported field in a config": (
        dict(generation_config=GenerationConfig(guidance_scale=2.0, max_new_tokens=3)), ValueError, ["guidance_scale=2.0"]
    ),
    "a field transformers adds later": (
        dict(generation_config=NewFieldConfig(speculative_widget=3, max_new_tokens=3)),
        ValueError,
        ["speculative_widget=3", "not supported"],
    ),
    "generation_config not a config": (dict(generation_config={"max_new_tokens": 3}), ValueError, ["dict"]),
    "unknown keyword": (dict(fast_mode=True), ValueError, ["fast_mode"]),
    "stop_strings without tokenizer": (dict(stop_strings=["stop"]), ValueError, ["stop_strings=['stop']", "tokenizer"]),
    "prompt longer than the context": (dict(input_ids=random_prompt(300)), ValueError, ["300 tokens", "1..255"]),
    "prompt that fills the context": (
        dict(input_ids=random_prompt(CONTEXT), max_new_tokens=1), ValueError, ["256 tokens fills", "1..255"]
    ),
    "max_new_tokens past the context": (
        dict(input_ids=random_prompt(250), max_new_tokens=10), ValueError, ["max_new_tokens (10)", "1..6"]
    ),
    "max_length shorter than the prompt": (dict(max_length=3, max_new_tokens=None), ValueError, ["max_length", "3"]),
}


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_bad_generate_arguments(spec, case):
    kwargs, error, names = GENERATE_CASES[case]
    kwargs = {"input_ids": PROMPT, "max_new_tokens": 4} | kwargs
    with pytest.raises(error) as info:
        spec.generate(kwargs.pop("input_ids"), **kwargs)
    for name in names:
        assert name in str(info.value), f"{case}: {name!r} not in {str(info.value)!r}"


def test_every_refused_generation_field_is_refused_and_the_rest_accounted_for(spec):
    """Each GenerationConfig field is implemented, without effect here, or refused when not at its default."""
    from selfspec.hf_generation import NO_EFFECT_FIELDS, SUPPORTED_FIELDS, generation_fields

    refused = generation_fields() - SUPPORTED_FIELDS - NO_EFFECT_FIELDS
    assert {"num_beams", "output_scores", "token_healing", "guidance_scale", "is_assistant"} <= refused
    defaults = GenerationConfig._get_default_generation_params()
    for name in sorted(refused):
        default = defaults.get(name)
        value = True if default is None or isinstance(default, bool) else (
            default + 3 if isinstance(default, (int, float)) else "unsupported")
        config = GenerationConfig(max_new_tokens=2)
        setattr(config, name, value)
        with pytest.raises(ValueError) as info:
            spec.generate(PROMPT, generation_config=config)
        assert name in str(info.value), str(info.value)


def test_integral_float_lengths_are_accepted_as_transformers_does(spec):
    model = spec.model
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=3.0), model.generate(PROMPT, max_new_tokens=3.0))


def test_int32_ids_give_int64_like_transformers(spec):
    out = spec.generate(PROMPT.int(), max_new_tokens=3)
    assert out.dtype == torch.int64 == spec.model.generate(PROMPT.int(), max_new_tokens=3).dtype


def test_a_failed_call_leaves_no_stale_stats(spec):
    spec.generate(PROMPT, max_new_tokens=3)
    assert spec.last_stats is not None
    with pytest.raises(ValueError):
        spec.generate(PROMPT, max_new_tokens=0)
    assert spec.last_stats is None

    class Boom(Exception):
        pass

    class Streamer:
        def put(self, value):
            if value.dim() == 1:
                raise Boom

        def end(self):
            pass

    spec.generate(PROMPT, max_new_tokens=3)
    with pytest.raises(Boom):
        spec.generate(PROMPT, max_new_tokens=3, streamer=Streamer())
    assert spec.last_stats is None


# --------------------------------------------------------------------------- plans

PLAN_CASES = {
    "layers with a float": (dict(layers=[0, 1.7]), ["1.7"]),
    "layers as strings": (dict(layers=["0", "2"]), ["'0'"]),
    "layers with a bool": (dict(layers=[0, True]), ["True"]),
    "layers a string": (dict(layers="012"), ["'012'"]),
    "exit_layer a string": (dict(exit_layer="2"), ["'2'"]),
    "exit_layer a float": (dict(exit_layer=2.0), ["2.0"]),
    "exit_layer a bool": (dict(exit_layer=True), ["True"]),
    "draft_length a string": (dict(exit_layer=2, draft_length="4"), ["'4'"]),
    "draft_length a bool": (dict(exit_layer=2, draft_length=True), ["True"]),
    "adaptive 'no'": (dict(exit_layer=2, adaptive="no"), ["'no'"]),
    "adaptive 1": (dict(exit_layer=2, adaptive=1), ["adaptive", "1"]),
    "threshold True": (dict(exit_layer=2, threshold=True), ["threshold=True"]),
    "threshold NaN": (dict(exit_layer=2, threshold=float("nan")), ["threshold=nan"]),
    "threshold a string": (dict(exit_layer=2, threshold="0.5"), ["'0.5'"]),
    "ngram a float": (dict(ngram=2.0), ["2.0"]),
    "draft_vocab_size without draft_vocab": (dict(exit_layer=2, draft_vocab_size=100), ["draft_vocab_size=100"]),
    "head a number": (dict(exit_layer=2, head=3), ["head", "3"]),
    "name a number": (dict(exit_layer=2, name=3), ["name", "3"]),
    "unknown field": (dict(exit_layer=2, speed="fast"), ["speed"]),
    "format": (dict(exit_layer=2, format="selfspec.plan/9"), ["selfspec.plan/9"]),
}


@pytest.mark.parametrize("case", PLAN_CASES)
def test_bad_plan_dicts(case, tmp_path):
    data, names = PLAN_CASES[case]
    with pytest.raises(ValueError) as info:
        selfspec.DraftPlan.from_dict(data)
    for name in names:
        assert name in str(info.value), f"{case}: {name!r} not in {str(info.value)!r}"
    path = tmp_path / "plan.json"  # the same through a plan file: the message also names the file
    path.write_text(json.dumps(data, allow_nan=True))
    with pytest.raises(ValueError) as info:
        selfspec.DraftPlan.load(path)
    assert str(path) in str(info.value) and names[0] in str(info.value)


@pytest.mark.parametrize(
    "text, names",
    [
        ("[0, 1]", ["list"]),
        ("null", ["NoneType"]),
        ('"exit_layer"', ["str"]),
        ('{"exit_layer": 2,', ["not valid JSON"]),
        ("", ["not valid JSON"]),
        (b"\xff\xfe{}", ["not valid JSON"]),
    ],
)
def test_bad_plan_files_name_the_file(tmp_path, text, names):
    path = tmp_path / "plan.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as info:
        selfspec.wrap(tiny_model("llama"), plan=str(path))
    assert str(path) in str(info.value)
    for name in names:
        assert name in str(info.value)


def test_plan_that_is_neither_dict_nor_path_nor_plan():
    with pytest.raises(ValueError, match="list"):
        selfspec.wrap(tiny_model("llama"), plan=[0, 1])


# --------------------------------------------------------------------------- artifacts


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], *, claim: int | None = None):
    """A .safetensors file written by hand, so that its header may lie."""
    header, offset, body = {}, 0, b""
    for name, (dtype, shape, data) in tensors.items():
        end = offset + (claim if claim is not None else len(data))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}
        offset, body = end, body + data
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def int64(values) -> bytes:
    return torch.tensor(values, dtype=torch.int64).numpy().tobytes()


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama", torch.float32)
    return model, selfspec.wrap(model, plan=selfspec.DraftPlan.plain()).parts


@pytest.fixture
def vocab_file(llama, tmp_path):
    return Path(make_vocab(llama[0], tmp_path / "vocab"))


def _vocab_with(path: Path, ids: list[int], counts: list[int] | None = None):
    counts = counts if counts is not None else [1] * len(ids)
    write_safetensors(path.with_suffix(".safetensors"), {
        "ids_by_count": ("I64", [len(ids)], int64(ids)), "counts": ("I64", [len(counts)], int64(counts)),
    })


VOCAB_CASES = {
    "id >= vocab": (lambda p: _vocab_with(p, [5, VOCAB + 4, 7]), ["token id 101", "index 1", "0..96"]),
    "negative id": (lambda p: _vocab_with(p, [5, -2, 7]), ["token id -2", "0..96"]),
    "duplicate id": (lambda p: _vocab_with(p, [5, 9, 9]), ["token id 9 appears 2 times"]),
    "more ids than the vocabulary": (lambda p: _vocab_with(p, list(range(VOCAB)) * 2), ["194 token ids", "1..97"]),
    "negative count": (lambda p: _vocab_with(p, [1, 2], [3, -1]), ["negative count -1"]),
    "lengths differ": (lambda p: _vocab_with(p, [1, 2], [3]), ["differ in length"]),
    "float ids": (
        lambda p: write_safetensors(p.with_suffix(".safetensors"), {
            "ids_by_count": ("F32", [1], bytes(4)), "counts": ("I64", [1], int64([1]))}),
        ["'ids_by_count' is F32"],
    ),
    "a header claiming 2M ids in a small file": (
        lambda p: write_safetensors(p.with_suffix(".safetensors"), {
            "ids_by_count": ("I64", [2_000_000], int64([1])), "counts": ("I64", [2_000_000], int64([1]))},
            claim=16_000_000),
        ["truncated or damaged"],
    ),
    "truncated tensor file": (
        lambda p: p.with_suffix(".safetensors").write_bytes(p.with_suffix(".safetensors").read_bytes()[:-9]),
        ["vocab.safetensors", "truncated"],
    ),
    "empty tensor file": (lambda p: p.with_suffix(".safetensors").write_bytes(b""), ["vocab.safetensors"]),
    "manifest not JSON": (lambda p: p.write_text("{"), ["vocab.json", "not valid JSON"]),
    "manifest a list": (lambda p: p.write_text("[]"), ["vocab.json", "list"]),
    "tensors outside the folder": (
        lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "tensors": "../x.safetensors"})),
        ["'../x.safetensors'"],
    ),
    "tensors missing": (
        lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "tensors": "gone.safetensors"})),
        ["gone.safetensors"],
    ),
}


@pytest.mark.parametrize("case", VOCAB_CASES)
def test_bad_vocabulary_files(llama, vocab_file, case):
    damage, names = VOCAB_CASES[case]
    damage(vocab_file)
    model, parts = llama
    with pytest.raises(ValueError) as info:
        load_vocab(vocab_file, 0, model=model, parts=parts)
    for name in names:
        assert name in str(info.value), f"{case}: {name!r} not in {str(info.value)!r}"


def _edit_manifest(path: Path, **changes):
    manifest = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    path.write_text(json.dumps(manifest))


def _reshape_head_tensor(path: Path):
    from safetensors.torch import load_file, save_file

    tensors_path = path.with_suffix(".safetensors")
    tensors = load_file(str(tensors_path))
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(tensors_path))
    return name


def _poison_head_tensor(value: float):
    """Put `value` (NaN or an infinity) into one weight of the head's file, as a diverged training would."""
    def damage(path: Path):
        from safetensors.torch import load_file, save_file

        tensors_path = path.with_suffix(".safetensors")
        tensors = load_file(str(tensors_path))
        name = sorted(tensors)[-1]
        tensors[name].view(-1)[3] = value
        save_file(tensors, str(tensors_path))
    return damage


HEAD_CASES = {
    "exit_layer a string": (lambda p: _edit_manifest(p, exit_layer="2"), ["exit_layer='2'", "1..5"]),
    "exit_layer out of range": (lambda p: _edit_manifest(p, exit_layer=9), ["exit_layer=9", "1..5"]),
    "source_layer missing": (lambda p: _edit_manifest(p, source_layer=...), ["'source_layer'"]),
    "source_layer a bool": (lambda p: _edit_manifest(p, source_layer=True), ["source_layer=True"]),
    "source_layer a list": (lambda p: _edit_manifest(p, source_layer=[5]), ["source_layer=[5]"]),
    "tensor of the wrong shape": (_reshape_head_tensor, ["of shape [3, 3]"]),
    "a NaN weight": (_poison_head_tensor(float("nan")), ["head.safetensors", "not finite", "1 of"]),
    "an infinite weight": (_poison_head_tensor(float("-inf")), ["head.safetensors", "not finite"]),
    "truncated tensor file": (
        lambda p: p.with_suffix(".safetensors").write_bytes(p.with_suffix(".safetensors").read_bytes()[:100]),
        ["head.safetensors"],
    ),
}


@pytest.mark.parametrize("case", HEAD_CASES)
def test_bad_head_files(llama, tmp_path, case):
    model, parts = llama
    path = Path(make_head(model, tmp_path / "head", exit_layer=2))
    damage, names = HEAD_CASES[case]
    damage(path)
    with pytest.raises(ValueError) as info:
        load_head(path, model=model, parts=parts)
    message = str(info.value)
    assert "head.json" in message or "head.safetensors" in message
    for name in names:
        assert name in message, f"{case}: {name!r} not in {message!r}"


# --------------------------------------------------------------------------- loading (the cache: tests/test_loading.py)


@pytest.mark.parametrize(
    "kwargs, error, names",
    [
        (dict(name_or_path=""), ValueError, ["unknown model ''"]),
        (dict(name_or_path="  "), ValueError, ["unknown model '  '"]),
        (dict(name_or_path=None), ValueError, ["None"]),
        (dict(name_or_path="no-such-model"), ValueError, ["'no-such-model'"]),
        (dict(name_or_path="smollm2", dtype="int8"), ValueError, ["'int8'", "float32"]),
    ],
)
def test_bad_load_arguments(kwargs, error, names):
    with pytest.raises(error) as info:
        loading.load(kwargs.pop("name_or_path"), **kwargs)
    for name in names:
        assert name in str(info.value)


# --------------------------------------------------------------------------- fuzz: loads, or ValueError

PLAN_FIELDS = ["layers", "exit_layer", "draft_length", "adaptive", "threshold", "target_acceptance",
               "threshold_step", "ngram", "head", "draft_vocab", "draft_vocab_size", "name", "format"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.sampled_from(["0", "2", "selfspec.plan/1", "no", "true"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=5), st.dictionaries(st.text(max_size=3), scalars, max_size=2))


@settings(max_examples=300, deadline=None)
@given(data=st.dictionaries(st.one_of(st.sampled_from(PLAN_FIELDS), st.text(max_size=5)), values, max_size=6))
def test_fuzz_plan_dicts(data):
    try:
        plan = selfspec.DraftPlan.from_dict(data)
    except ValueError as error:
        assert str(error)
        return
    for key, value in data.items():  # loaded: nothing was coerced
        if key == "format":
            continue
        got = getattr(plan, key)
        if key == "layers" and value is not None:
            assert list(got) == list(value) and all(type(i) is int for i in got)
        else:
            assert got == value and type(got) is type(value), (key, value, got)


@settings(max_examples=100, deadline=None)
@given(data=st.one_of(values, st.dictionaries(st.sampled_from(PLAN_FIELDS), values, max_size=4)),
       raw=st.one_of(st.none(), st.binary(max_size=20)))
def test_fuzz_plan_files(tmp_path_factory, data, raw):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_bytes(raw if raw is not None else json.dumps(data).encode())
    try:
        selfspec.DraftPlan.load(path)
    except ValueError as error:
        assert str(path) in str(error)


MANIFEST_KEYS = ["format", "kind", "tensors", "model", "exit_layer", "source_layer", "source", "shape"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(MANIFEST_KEYS), st.one_of(values, st.just(...)), max_size=3),
       ids=st.one_of(st.none(), st.lists(st.integers(-2, VOCAB + 2), min_size=0, max_size=8)))
def test_fuzz_artifact_manifests(llama, tmp_path_factory, changes, ids):
    model, parts = llama
    folder = tmp_path_factory.mktemp("artifacts")
    vocab, head = Path(make_vocab(model, folder / "vocab")), Path(make_head(model, folder / "head", exit_layer=2))
    for path in (vocab, head):
        _edit_manifest(path, **changes)
    if ids is not None:
        _vocab_with(vocab, ids)
    for load in (lambda: load_vocab(vocab, 0, model=model, parts=parts),
                 lambda: load_head(head, model=model, parts=parts)):
        try:
            load()
        except ValueError as error:
            assert str(error)
