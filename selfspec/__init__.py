"""selfspec: self-speculative decoding for Hugging Face causal LMs, with no second model.

    import selfspec
    model, tokenizer = selfspec.load("smollm2-135m-instruct")
    spec = selfspec.wrap(model)
    out = spec.generate(input_ids, max_new_tokens=128)
    print(spec.last_stats)
"""

from .registry import supported_model_types
from .engine import SelfSpecModel, wrap
from .memory import MemoryReport
from .plan import DraftPlan
from .batch import BatchSession
from .stats import BatchStats, GenerationStats

__all__ = ["BatchSession", "BatchStats", "DraftPlan", "GenerationStats", "MemoryReport", "SelfSpecModel", "load", "supported_model_types", "wrap"]
__version__ = "0.1.0"


def load(name_or_path: str, **options):
    """Load a model and its tokenizer by known name or local path; see `selfspec.loading.load`."""
    from .loading import load as _load

    return _load(name_or_path, **options)
