"""selfspec: self-speculative decoding for Hugging Face causal LMs, with no second model.

    import selfspec
    model, tokenizer = selfspec.load("smollm2-135m-instruct")
    spec = selfspec.wrap(model)
    out = spec.generate(input_ids, max_new_tokens=128)
    print(spec.last_stats)
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batch import BatchSession
    from .engine import SelfSpecModel, wrap
    from .memory import MemoryReport
    from .plan import DraftPlan
    from .registry import supported_model_types
    from .stats import BatchStats, GenerationStats

__all__ = ["BatchSession", "BatchStats", "DraftPlan", "GenerationStats", "MemoryReport", "SelfSpecModel", "load", "supported_model_types", "wrap"]
__version__ = "0.1.0"

# Imported on first use (torch and transformers take seconds): `import selfspec.cli` parses arguments, and
# reports them, or a Ctrl-C, in one line, before those imports start.
_EXPORTS = {"supported_model_types": "registry", "SelfSpecModel": "engine", "wrap": "engine",
            "MemoryReport": "memory", "DraftPlan": "plan", "BatchSession": "batch", "BatchStats": "stats",
            "GenerationStats": "stats"}


def __getattr__(name: str):
    if name not in _EXPORTS:  # a submodule (`selfspec.costs`), as the eager imports once made them all attributes
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'selfspec' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load(name_or_path: str, **options):
    """Load a model and its tokenizer by known name or local path; see `selfspec.loading.load`."""
    from .loading import load as _load

    return _load(name_or_path, **options)
