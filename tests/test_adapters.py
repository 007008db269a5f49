"""The shared adapter runner: every adapter, one tiny random model each, the same checks.

For every architecture in `selfspec.testing.TINY_CONFIGS` (float32):
- its adapter is found by `model_type` and passes the self-check (one
  draft-and-verify round against a plain forward pass);
- greedy self-speculative output equals `model.generate(do_sample=False)` token
  for token, property-based over plans (random layer subsets, exit layers,
  draft lengths, adaptive policy) and prompts; families with sliding-window
  attention run with a window of 8 and prompts of 20+ tokens, longer than it;
- the adapter's default plan is lossless too;
- seeded sampling runs and reproduces.

Then the adapters' named mechanisms and the refusals: configs an adapter does
not support, and models without an adapter (the generic adapter after its
self-check, or a clear error).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import selfspec
from selfspec.adapter import Adapter
from selfspec.cache import SharedKVCache
from selfspec.registry import adapter_for, all_adapters, supported_model_types
from selfspec.generic import GenericAdapterWarning, self_check
from plan_strategies import assert_same, plans
from selfspec.testing import COMMON, TINY_CONFIGS, has_window, random_prompt, tiny_model

ARCHS = sorted(TINY_CONFIGS)
SHORT_WINDOW = 8
ISSUE_MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3", "olmo2", "gpt2"]


def model_for(arch: str):
    """float32; windowed families with a window shorter than the prompts below."""
    return tiny_model(arch, torch.float32, window=SHORT_WINDOW if has_window(arch) else None)


# -- every adapter ------------------------------------------------------------------


def test_issue_families_are_supported_and_each_adapter_has_a_tiny_model():
    assert set(ISSUE_MODEL_TYPES) <= set(supported_model_types())
    covered = {adapter_for(tiny_model(arch)).name for arch in ARCHS}
    assert covered == {adapter.name for adapter in all_adapters()}, "an adapter file without a line in TINY_CONFIGS"


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_found_by_model_type_and_passes_self_check(arch):
    model = model_for(arch)
    adapter = adapter_for(model)
    assert model.config.model_type in adapter.model_types
    check = self_check(model, adapter)
    assert check.passed, check.detail


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_greedy_matches_generate(arch, data):
    model = model_for(arch)
    plan = data.draw(plans(model.config.get_text_config().num_hidden_layers, max_draft_length=8), label="plan")
    shortest = 20 if has_window(arch) else 1  # longer than the sliding window
    length = data.draw(st.integers(shortest, 30), label="prompt length")
    prompt = random_prompt(length, seed=data.draw(st.integers(0, 999), label="prompt seed"))
    max_new = data.draw(st.integers(1, 30), label="max_new_tokens")
    ref = model.generate(prompt, do_sample=False, max_new_tokens=max_new)
    spec = selfspec.wrap(model, plan=plan)
    assert_same(spec.generate(prompt, max_new_tokens=max_new), ref, plan)
    assert 1.0 <= spec.last_stats.tokens_per_pass <= plan.draft_length + 1


@pytest.mark.parametrize("arch", ARCHS)
def test_default_plan_is_lossless(arch):
    """With no tuned plan the default is an auto plan; the adapter's old rule (an early exit) still works."""
    model = model_for(arch)
    spec = selfspec.wrap(model)
    assert spec.plan.auto and spec.plan.name == f"{spec.adapter.name}-auto"
    prompt = random_prompt(24, seed=5)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=32)
    assert_same(spec.generate(prompt, max_new_tokens=32), ref, spec.plan)
    assert spec.last_stats.layer_sets.startswith("round 0:")
    rule = spec.adapter.rule_plan(model.config)
    assert rule.exit_layer and rule.name == f"{spec.adapter.name}-default"
    assert_same(selfspec.wrap(model, plan=rule).generate(prompt, max_new_tokens=32), ref, rule)


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampling_runs_and_reproduces(arch):
    model = model_for(arch)
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(layers=[0, 2, 3, 5], draft_length=4, policy="fixed"))
    prompt = random_prompt(22, seed=6)

    def sample(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return spec.generate(prompt, do_sample=True, temperature=0.9, top_k=20, max_new_tokens=25, generator=generator)

    first, again = sample(1), sample(1)
    assert torch.equal(first, again)
    assert first.shape == (1, 22 + 25) and torch.equal(first[:, :22], prompt)
    assert int(first.max()) < COMMON["vocab_size"] and spec.last_stats.new_tokens == 25
    assert any(not torch.equal(sample(seed), first) for seed in (2, 3, 4))


# -- the named mechanisms ---------------------------------------------------------------


@pytest.mark.parametrize("arch", [a for a in ARCHS if has_window(a)])
def test_prompt_longer_than_the_sliding_window(arch):
    model = model_for(arch)
    parts = adapter_for(model).bind(model)
    assert SHORT_WINDOW in parts.windows
    prompt = random_prompt(27, seed=7)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
    num_layers = parts.num_layers
    global_layers = [i for i, w in enumerate(parts.windows) if w is None]
    sliding_only = [i for i, w in enumerate(parts.windows) if w is not None]
    for plan in (
        selfspec.DraftPlan(exit_layer=num_layers // 2, draft_length=6, policy="fixed"),
        selfspec.DraftPlan(layers=sliding_only, draft_length=5, policy="fixed"),  # skips every global layer (if any)
        selfspec.DraftPlan(layers=sorted({0, *global_layers} if global_layers else {0, num_layers - 1}), draft_length=3, policy="fixed"),
    ):
        assert_same(selfspec.wrap(model, plan=plan).generate(prompt, max_new_tokens=30), ref, plan)


@pytest.mark.parametrize("arch", [a for a in ARCHS if has_window(a)])
def test_windowed_layers_attend_only_to_the_entries_their_window_shows(arch, monkeypatch):
    """As transformers' own sliding cache layers: a windowed layer gets the entries from its pass's first
    query - window + 1 on (a one-token step: `window` entries), not the whole context; chains, trees and n-gram
    proposals stay equal to `model.generate`. Global layers get every entry."""
    seen = []  # (window, new entries, entries returned, entries held, first query)
    real = SharedKVCache.update

    def spy(self, key, value, layer_idx, *args, **kwargs):
        keys, values = real(self, key, value, layer_idx, *args, **kwargs)
        seen.append((self.windows[layer_idx], key.shape[-2], keys.shape[-2], self.lengths[layer_idx],
                     self.first_query))
        return keys, values

    monkeypatch.setattr(SharedKVCache, "update", spy)
    model = model_for(arch)
    num_layers = model.config.get_text_config().num_hidden_layers
    prompt = random_prompt(27, seed=5)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
    for plan in (selfspec.DraftPlan.plain(),
                 selfspec.DraftPlan(layers=tuple(range(num_layers // 2)), draft_length=4, ngram=2, tree=6,
                                    policy="fixed")):
        assert_same(selfspec.wrap(model, plan=plan).generate(prompt, max_new_tokens=30), ref, plan)
    windowed = [s for s in seen if s[0] is not None]
    assert windowed and all(s[2] == s[3] for s in seen if s[0] is None)
    assert all(returned == held - max(0, first - window + 1) for window, _, returned, held, first in windowed)
    steps = [s for s in windowed if s[1] == 1 and s[3] > s[0]]  # one-token steps past the window
    assert steps and all(returned == window for window, _, returned, _, _ in steps)


def test_layouts_read_from_the_config():
    gemma3 = adapter_for(model_for("gemma3_text")).bind(model_for("gemma3_text"))
    assert gemma3.windows == (8, 8, None, 8, 8, None)
    assert gemma3.rotary_kinds == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert gemma3.logit_softcap == 15.0
    multimodal = adapter_for(model_for("gemma3")).bind(model_for("gemma3"))  # read from config.text_config
    assert multimodal.windows == (8, 8, None, 8, 8, None) and multimodal.logit_softcap is None
    gemma2 = adapter_for(model_for("gemma2")).bind(model_for("gemma2"))
    assert gemma2.attn_implementation == "eager" and gemma2.logit_softcap == 15.0
    qwen2 = adapter_for(model_for("qwen2")).bind(model_for("qwen2"))
    assert qwen2.windows == (None, None, 8, 8, 8, 8)  # max_window_layers=2
    assert adapter_for(model_for("mistral")).bind(model_for("mistral")).windows == (8,) * 6
    gpt2 = adapter_for(model_for("gpt2")).bind(model_for("gpt2"))
    assert gpt2.position_embed is not None and gpt2.rotary is None
    llama = adapter_for(model_for("llama")).bind(model_for("llama"))
    assert llama.windows == (None,) * 6 and llama.logit_softcap is None and llama.position_embed is None


def test_tied_embeddings_share_one_matrix():
    for arch in ("gemma2", "gemma3_text", "gpt2", "qwen2", "qwen3"):
        model = model_for(arch)
        parts = adapter_for(model).bind(model)
        assert parts.lm_head.weight is parts.embed.weight, arch


def test_eager_attention_uses_additive_masks_and_stays_lossless():
    config = transformers.LlamaConfig(**COMMON, sliding_window=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    prompt = random_prompt(12, seed=8)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=20)
    plan = selfspec.DraftPlan(layers=[0, 1, 4], draft_length=4, policy="fixed")
    assert_same(selfspec.wrap(model, plan=plan).generate(prompt, max_new_tokens=20), ref, plan)


# -- refusals ---------------------------------------------------------------------------------


def test_config_values_an_adapter_does_not_support_are_refused():
    config = transformers.Gemma3TextConfig(
        **COMMON, head_dim=8, query_pre_attn_scalar=8, pad_token_id=0, use_bidirectional_attention=True
    )
    model = transformers.Gemma3ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="use_bidirectional_attention=False only.*use_bidirectional_attention=True"):
        selfspec.wrap(model)
    config = transformers.LlamaConfig(**COMMON, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        selfspec.wrap(transformers.LlamaForCausalLM(config))


def test_unknown_adapter_keys_are_an_error(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text(
        'name = "x"\nmodel_types = ["x"]\n[modules]\nembed = "a"\nlayers = "b"\nnorm = "c"\nlm_head = "d"\nrotay = "e"\n'
    )
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['modules.rotay'\]"):
        Adapter.from_toml(path)


# -- models without an adapter ---------------------------------------------------------------------


def renamed(config_cls: str, model_cls: str, model_type: str, **overrides):
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    config.model_type = model_type  # a fine-tune that reuses a known layout under a new name
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


def test_llama_layout_under_a_new_model_type_runs_generic_after_its_self_check():
    model = renamed("LlamaConfig", "LlamaForCausalLM", "my_llama_finetune")
    with pytest.warns(GenericAdapterWarning, match="'my_llama_finetune'.*generic decoder adapter.*passed its self-check"):
        spec = selfspec.wrap(model)
    assert spec.adapter.name == "generic"
    prompt = random_prompt(10, seed=9)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
    for plan in (selfspec.DraftPlan(exit_layer=3, draft_length=5), selfspec.DraftPlan(layers=[1, 2, 5], adaptive=True, policy="fixed")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GenericAdapterWarning)
            out = selfspec.wrap(model, plan=plan).generate(prompt, max_new_tokens=30)
        assert_same(out, ref, plan)


def test_common_layout_with_an_unknown_quirk_fails_the_self_check():
    # Granite scales the embeddings and the logits in the model's forward: quirks the generic adapter does not know.
    model = renamed("GraniteConfig", "GraniteForCausalLM", "my_granite", embedding_multiplier=3.0, logits_scaling=4.0)
    with pytest.raises(ValueError, match="failed its self-check: .*max relative logit error") as info:
        selfspec.wrap(model)
    assert "Supported model types: " in str(info.value) and "adapters/README.md" in str(info.value)
    # Gemma 3's rotary module wants a layer type: the round raises, and the check reports it.
    model = renamed("Gemma3TextConfig", "Gemma3ForCausalLM", "my_gemma3", head_dim=8, query_pre_attn_scalar=8,
                    pad_token_id=0, sliding_window=None, layer_types=["full_attention"] * 6)
    with pytest.raises(ValueError, match="failed its self-check: the round raised"):
        selfspec.wrap(model)


def test_sliding_window_config_without_adapter_is_refused():
    model = renamed("MistralConfig", "MistralForCausalLM", "my_mistral", sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=8"):
        selfspec.wrap(model)


def test_other_layouts_get_the_list_of_supported_types():
    config = transformers.OPTConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16
    )
    with pytest.raises(ValueError) as info:
        selfspec.wrap(transformers.OPTForCausalLM(config))
    message = str(info.value)
    assert "model_type='opt'" in message and "no module 'model.embed_tokens'" in message
    assert all(model_type in message for model_type in ISSUE_MODEL_TYPES)
    assert "adapters/README.md" in message
