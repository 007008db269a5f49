"""The optional `llama-cpp` benchmark method: skipped in one line without llama-cpp-python, converted once, and
decoding as `model.generate` does (stop at EOS, kept, or after max_new_tokens; one pass per token).

The fast tests run without llama-cpp-python: a stand-in `Llama` and a stand-in converter. The slow one decodes the
real SmolLM2 in float32 with llama.cpp and compares with `model.generate`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import llama_cpp as lc
from benchmarks import methods, run
from benchmarks.measure import measure
from benchmarks.workload import Prompt
from selfspec.testing import random_prompt, tiny_model


def hf_folder(path: Path, weights: bytes = b"weights") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_without_llama_cpp_python_the_method_is_skipped_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` fails, find_spec says None
    assert not methods.llama_cpp_installed()
    model = tiny_model("llama", torch.float32)
    prompts = [Prompt("p", "c", "", random_prompt(6))]
    args = SimpleNamespace(prompt_lookup=10, costs=None, plans=[], max_new_tokens=4)
    built, failed = run.build_methods(["hf-greedy", "llama-cpp"], model, args, None, 1, prompts,
                                      torch.device("cpu"))
    assert [m.name for m in built] == ["hf-greedy"]
    assert "pip install llama-cpp-python" in failed["llama-cpp"]
    skipped = [line for line in capsys.readouterr().out.splitlines() if "llama-cpp" in line]
    assert len(skipped) == 1 and skipped[0].startswith("skipped llama-cpp: ModuleNotFoundError")


def test_llama_cpp_is_a_default_method_only_where_installed_and_on_a_cpu(monkeypatch):
    assert "llama-cpp" in methods.ALL_METHODS
    monkeypatch.setattr(methods, "llama_cpp_installed", lambda: False)
    assert "llama-cpp" not in methods.default_methods(None, "cpu")
    monkeypatch.setattr(methods, "llama_cpp_installed", lambda: True)
    assert "llama-cpp" in methods.default_methods(None, "cpu")
    assert "llama-cpp" not in methods.default_methods(None, "cuda")


def test_only_float32_and_bfloat16_float_weights_on_a_cpu():
    assert lc.check_model(tiny_model("llama", torch.float32)) == "f32"
    assert lc.check_model(tiny_model("llama", torch.bfloat16)) == "bf16"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        lc.check_model(tiny_model("llama", torch.float16))


def test_without_a_converter_it_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv(lc.CONVERTER_ENV, str(tmp_path / "empty"))
    folder = hf_folder(tmp_path / "model")
    with pytest.raises(FileNotFoundError, match=f"set {lc.CONVERTER_ENV} to llama.cpp's convert_hf_to_gguf.py"):
        lc.convert(folder, "f32", tmp_path / "cache" / "model-f32.gguf")


def test_the_gguf_is_converted_once_and_keyed_by_the_weights(tmp_path, monkeypatch):
    script = tmp_path / "llama.cpp" / lc.CONVERTER
    script.parent.mkdir()
    calls = tmp_path / "calls"
    script.write_text(  # a stand-in converter: writes --outfile and counts its runs
        "import sys\n"
        f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "open(sys.argv[sys.argv.index('--outfile') + 1], 'wb').write(b'GGUF')\n")
    monkeypatch.setenv(lc.CONVERTER_ENV, str(script.parent))
    folder = hf_folder(tmp_path / "model")
    target = lc.gguf_path(folder, "bf16", tmp_path / "cache")
    assert target.name.startswith("model-") and target.name.endswith("-bf16.gguf")
    assert lc.convert(folder, "bf16", target) == target and lc.convert(folder, "bf16", target) == target
    assert target.read_bytes() == b"GGUF"
    assert len(calls.read_text().splitlines()) == 1 and "--outtype bf16" in calls.read_text()
    assert not list(target.parent.glob(".*partial"))
    hf_folder(folder, b"other weights")
    assert lc.gguf_path(folder, "bf16", tmp_path / "cache") != target


class StandInLlama:
    """Yields a scripted token sequence from `generate`; counts resets."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.resets, self.closed = script, 0, 0

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens, **options):
        assert options["temp"] == 0.0 and options["top_k"] == 1
        try:
            yield from self.script
        finally:
            self.closed += 1


@pytest.mark.parametrize("eos, max_new, expected", [(5, 10, [3, 4, 5]), (None, 4, [3, 4, 5, 6]), (None, 2, [3, 4])])
def test_it_stops_as_generate_does(tmp_path, monkeypatch, eos, max_new, expected):
    model = tiny_model("llama", torch.float32)
    model.name_or_path = str(hf_folder(tmp_path / "model"))
    model.generation_config.eos_token_id = eos
    llm = StandInLlama([3, 4, 5, 6, 7, 8])
    monkeypatch.setattr(lc, "require_llama_cpp", lambda: SimpleNamespace(__version__="stand-in"))
    monkeypatch.setattr(lc, "convert", lambda folder, outtype, target: target)
    monkeypatch.setattr(lc, "load_llama", lambda path, threads, outtype: llm)
    method = lc.llama_cpp_method(model, max_new_tokens=max_new, threads=2)
    prompt = Prompt("p", "c", "", random_prompt(5))
    row = measure(method, prompt, torch.device("cpu"))
    assert row.error is None and row.output == expected
    assert row.verify_passes == len(expected) and row.first_token_seconds is not None
    assert llm.resets == 1 and llm.closed == 1
    assert method.settings["n_threads"] == 2 and method.settings["gguf_type"] == "f32"


@pytest.mark.slow
def test_real_smollm2_float32_matches_generate():
    pytest.importorskip("llama_cpp")
    import selfspec

    model, tokenizer = selfspec.load("smollm2-135m-instruct", dtype="float32")
    folder = lc.model_folder(model)
    if not lc.gguf_path(folder, "f32").is_file() and lc.find_converter() is None:
        pytest.skip(f"no cached F32 GGUF and no converter (set {lc.CONVERTER_ENV})")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    method = lc.llama_cpp_method(model, max_new_tokens=24)
    out, counts = method.run(ids)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
    assert out.tolist() == expected.tolist() and counts.verify_passes == out.shape[1] - ids.shape[1]
