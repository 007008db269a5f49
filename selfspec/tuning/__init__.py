"""Plan search: which layers the draft runs and how many tokens it drafts, tuned for measured speed.

    from selfspec.prompts import builtin_prompts, encode_prompts
    from selfspec.tuning import TuneConfig, tune
    prompts = encode_prompts(tokenizer, builtin_prompts())
    result = tune(model, prompts=prompts[:10], heldout=prompts[10:15], config=TuneConfig(budget=200))
    result.best_plan.save("plan.json")       # wrap(model, plan="plan.json")
    print(result.table())

The steps and the modules that own them are listed in `pipeline`.
"""

from __future__ import annotations

from .adapter_toml import adapter_entry
from .cost import CostModel
from .pipeline import TuneConfig, tune
from .report import TuneResult

__all__ = ["CostModel", "TuneConfig", "TuneResult", "adapter_entry", "tune"]
