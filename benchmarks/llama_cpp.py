"""The `llama-cpp` method: llama.cpp's plain greedy decoding of the same weights, the CPU anchor.

Optional: it needs llama-cpp-python (`pip install llama-cpp-python`), which is
not a requirement of selfspec. Without it the harness skips the method in one
line and leaves it out of the default methods.

The weights are the model's own Hugging Face folder (for `selfspec.load` names,
the converted cache folder), written once as an F32 or BF16 GGUF, the model's
dtype, by llama.cpp's `convert_hf_to_gguf.py`, and cached as
`<selfspec cache>/llama-cpp/<folder>-<key>-<f32|bf16>.gguf`; the key changes
with the folder's weight files (path, size, time). A llama-cpp-python wheel
does not ship the converter: `LLAMA_CPP_CONVERT` names the script (or a
llama.cpp checkout, or an unpacked llama-cpp-python sdist). The converter
imports `sentencepiece` even for BPE tokenizers.

The method decodes the prompt's token ids (no tokenizer round trip) on the
harness's thread count, with a KV cache in the model's dtype, sampling greedily
(`temp=0`); it stops at the model's `generation_config.eos_token_id` (kept, as
`generate` keeps it) or after `max_new_tokens`, as `model.generate` does. One
llama.cpp decode per new token, the prefill's included.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from selfspec.loading import default_cache_dir
from selfspec.quant import describe_quantization

from .methods import STATIC_CACHE_LENGTH, Method, PassCounts, llama_cpp_installed

NAME = "llama-cpp"
CONVERTER_ENV = "LLAMA_CPP_CONVERT"
CONVERTER = "convert_hf_to_gguf.py"
GGUF_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # model dtype -> the converter's --outtype
GGML_KV_TYPES = {"f32": 0, "bf16": 30}  # ggml's GGML_TYPE_F32 and GGML_TYPE_BF16 (llama_cpp exports no BF16 name)
CONTEXT = STATIC_CACHE_LENGTH  # positions of the llama.cpp context: prompt + new tokens must fit

_models: dict[tuple, object] = {}  # (gguf, threads, context, kv type) -> llama_cpp.Llama: one per process


def require_llama_cpp():
    if not llama_cpp_installed():
        raise ModuleNotFoundError(f"{NAME} needs llama-cpp-python (optional, not a selfspec requirement): "
                                  "pip install llama-cpp-python", name="llama_cpp")
    import llama_cpp

    return llama_cpp


def model_folder(model) -> Path:
    """The Hugging Face folder the model was read from: its config.json and safetensors are what is converted."""
    folder = Path(str(getattr(model, "name_or_path", "") or ""))
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise ValueError(f"{NAME} converts the model's Hugging Face folder (config.json + safetensors); "
                         f"{str(folder)!r} is none")
    return folder.resolve()


def gguf_path(folder: Path, outtype: str, cache_dir: Path | None = None) -> Path:
    """Where the folder's GGUF in `outtype` is cached; the name changes when the folder's weights do."""
    identity = [str(folder)]
    for path in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        stat = path.stat()
        identity.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    key = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:12]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "llama-cpp"
    return base / f"{folder.name}-{key}-{outtype}.gguf"


def find_converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py: from $LLAMA_CPP_CONVERT (the script, a llama.cpp checkout or an unpacked
    llama-cpp-python sdist), else beside an llama_cpp package installed from a source checkout; None if not found."""
    places = []
    given = os.environ.get(CONVERTER_ENV)
    if given:
        places.append(Path(given).expanduser())
    elif llama_cpp_installed():
        spec = importlib.util.find_spec("llama_cpp")
        if spec is not None and spec.origin:
            places.append(Path(spec.origin).resolve().parent.parent)
    for place in places:
        for candidate in (place, place / CONVERTER, place / "vendor" / "llama.cpp" / CONVERTER):
            if candidate.is_file() and candidate.name == CONVERTER:
                return candidate
    return None


def no_converter_message(target: Path, outtype: str) -> str:
    given = os.environ.get(CONVERTER_ENV)
    where = f"${CONVERTER_ENV}={given} holds no {CONVERTER}" if given else f"{CONVERTER} not found"
    return (f"no {outtype.upper()} GGUF at {target} and {where} (llama-cpp-python's wheels do not ship it): set "
            f"{CONVERTER_ENV} to llama.cpp's {CONVERTER}, e.g. from a llama.cpp checkout or vendor/llama.cpp/ of "
            "the sdist (pip download --no-binary :all: --no-deps llama-cpp-python), or write that GGUF there")


def convert(folder: Path, outtype: str, target: Path, converter: Path | None = None) -> Path:
    """Write `folder` as a GGUF in `outtype` at `target` (once: an existing file is used as it is)."""
    if target.is_file():
        return target
    converter = converter or find_converter()
    if converter is None:
        raise FileNotFoundError(no_converter_message(target, outtype))
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.{os.getpid()}.partial")
    print(f"{NAME}: converting {folder} once to {outtype.upper()} GGUF {target}", flush=True)
    try:
        done = subprocess.run([sys.executable, str(converter), str(folder), "--outtype", outtype,
                               "--outfile", str(staged)], capture_output=True, text=True)
        if done.returncode != 0 or not staged.is_file():
            lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            last = lines[-1] if lines else f"exit status {done.returncode}"
            hint = " (pip install sentencepiece: the converter imports it)" if "sentencepiece" in last else ""
            raise RuntimeError(f"{converter} failed on {folder}: {last}{hint}")
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)
    return target


def check_model(model) -> str:
    """The GGUF type for this model (f32 or bf16); a ValueError where llama-cpp cannot stand in for it."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"{NAME} runs on the CPU only; the model is on {device}")
    if model.dtype not in GGUF_TYPES:
        raise ValueError(f"{NAME} runs float32 or bfloat16 weights; the model is {model.dtype}")
    quantized = describe_quantization(model)
    if quantized:
        raise ValueError(f"{NAME} runs the float weights; this model is quantized ({quantized})")
    return GGUF_TYPES[model.dtype]


def eos_ids(model) -> set[int]:
    """The tokens `model.generate` stops at."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])}


def load_llama(path: Path, threads: int, outtype: str, context: int = CONTEXT):
    """One `llama_cpp.Llama` per GGUF, thread count and context in a process (the warm-up and the run share it)."""
    llama_cpp = require_llama_cpp()
    kv_type = GGML_KV_TYPES[outtype]
    key = (str(path), threads, context, kv_type)
    if key not in _models:
        _models[key] = llama_cpp.Llama(
            model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, logits_all=False,
            type_k=kv_type, type_v=kv_type, verbose=False,
        )
    return _models[key]


def llama_cpp_method(model, *, max_new_tokens: int, threads: int | None = None) -> Method:
    """Plain greedy decoding by llama.cpp of the model's weights in its dtype, on `threads` (default: torch's)."""
    llama_cpp = require_llama_cpp()
    outtype = check_model(model)
    folder = model_folder(model)
    path = convert(folder, outtype, gguf_path(folder, outtype))
    threads = threads or torch.get_num_threads()
    llm = load_llama(path, threads, outtype)
    stop = eos_ids(model)

    def run(input_ids: torch.Tensor, streamer=None) -> tuple[torch.Tensor, PassCounts]:
        if input_ids.shape[0] != 1:
            raise ValueError(f"{NAME} decodes one prompt at a time; got a batch of {input_ids.shape[0]}")
        prompt = input_ids[0].tolist()
        if len(prompt) + max_new_tokens > CONTEXT:
            raise ValueError(f"{NAME}: {len(prompt)} prompt + {max_new_tokens} new tokens exceed its context "
                             f"of {CONTEXT}")
        if streamer is not None:
            streamer.put(input_ids.cpu())
        new: list[int] = []
        llm.reset()  # no reuse of the previous call's cache: every prompt is prefilled in full
        if max_new_tokens > 0:
            tokens = llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
            try:
                for token in tokens:
                    new.append(int(token))
                    if streamer is not None:
                        streamer.put(torch.tensor([token]))
                    if token in stop or len(new) >= max_new_tokens:
                        break
            finally:
                tokens.close()
        if streamer is not None:
            streamer.end()
        out = torch.tensor([prompt + new], dtype=input_ids.dtype, device=input_ids.device)
        return out, PassCounts(verify_passes=len(new))

    settings = {"gguf": str(path), "gguf_type": outtype, "kv_cache_type": outtype, "n_threads": threads,
                "n_ctx": CONTEXT, "sampling": "greedy (temp=0)", "llama_cpp_python": llama_cpp.__version__}
    return Method(NAME, f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), {outtype.upper()} GGUF, greedy",
                  run, settings=settings)
