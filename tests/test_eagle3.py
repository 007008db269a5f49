"""Feature heads of EAGLE-3's layout (`eagle3.py`) and their export (`training/eagle3_export.py`).

Lossless on every Llama-structured family, in one sequence, a batch and the
static step; refused, with the reason, elsewhere. The export is read back and
checked name by name and shape by shape against the layout vLLM and SGLang
load, and a forward pass written here from those tensors alone (as such an
engine computes it, the layer ids counting the embedding as 0) must give the
head's own draft distribution.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

import selfspec
from plan_strategies import assert_same
from test_batch import assert_rows_alone, repetitive
from selfspec.cli import main
from selfspec.feature_head import FeatureHead, load_feature_head
from selfspec.registry import model_parts
from selfspec.runner import LayerRunner
from selfspec.testing import (make_feature_head, make_vocab, random_prompt, save_tiny_llama, save_word_tokenizer,
                              tiny_model)
from selfspec.training.eagle3_export import export_eagle3, layout_problem
from selfspec.training.feature_distill import target_states, unrolled_states
from selfspec.vocab import load_vocab

LLAMA_STRUCTURED = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("arch", LLAMA_STRUCTURED)
def test_an_eagle3_head_is_lossless(arch, tmp_path):
    model = tiny_model(arch)
    head = str(make_feature_head(model, tmp_path / "head", layout="eagle3"))
    vocab = str(make_vocab(model, tmp_path / "vocab"))
    plans = [selfspec.DraftPlan(head=head, draft_length=4, policy="fixed"),
             selfspec.DraftPlan(head=head, draft_length=3, ngram=2, policy="fixed"),
             selfspec.DraftPlan(head=head, draft_vocab=vocab, draft_vocab_size=20, draft_length=4, policy="fixed"),
             selfspec.DraftPlan(head=head, tree=8, draft_length=4, policy="fixed"),
             selfspec.DraftPlan(head=head, draft_length=5)]  # the cost policy
    drafted = 0
    for seed, plan in enumerate(plans):
        prompt = random_prompt(6 + 3 * seed, seed=seed)
        for step in ("eager", "static") if arch == "llama" else ("eager",):
            spec = selfspec.wrap(model, plan=plan, costs="flat", step=step)
            out = spec.generate(prompt, max_new_tokens=27)
            assert_same(out, model.generate(prompt, do_sample=False, max_new_tokens=27), plan)
            drafted += spec.last_stats.layer_drafted
    assert drafted > 0
    loaded = load_feature_head(head, model=model, parts=model_parts(model))
    assert loaded.layout == "eagle3" and loaded.join is None


def test_an_eagle3_head_drafts_for_every_row_of_a_batch(tmp_path):
    model = tiny_model("qwen2", torch.float64)
    head = make_feature_head(model, tmp_path / "head", layout="eagle3")
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan(head=str(head), draft_length=4, policy="fixed"))
    assert_rows_alone(model, spec, [repetitive(14, seed=3), repetitive(6, seed=4), repetitive(3, seed=5)],
                      max_new_tokens=21)
    assert spec.last_stats.drafted > 0


@pytest.mark.parametrize("arch", ["gemma3_text", "phi3", "olmo2", "gpt2"])
def test_other_layers_are_refused_with_the_reason(arch):
    with pytest.raises(ValueError, match="layout 'eagle3' needs a Llama-structured layer: .* has modules"):
        FeatureHead.from_model(model_parts(tiny_model(arch)), layout="eagle3")
    with pytest.raises(ValueError, match="not a feature-head layout"):
        FeatureHead.from_model(model_parts(tiny_model("llama")), layout="eagle-3")


def test_a_manifest_naming_an_unknown_layout_is_refused(tmp_path):
    model = tiny_model("llama")
    path = make_feature_head(model, tmp_path / "head", layout="eagle3")
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "layout": "eagle-3"}))
    with pytest.raises(ValueError, match="layout='eagle-3' is not a feature-head layout"):
        load_feature_head(path, model=model, parts=model_parts(model))


def test_train_head_refuses_eagle3_for_another_family_before_generating(tmp_path, capsys):
    folder = tmp_path / "gemma"
    tiny_model("gemma3_text", torch.float32).save_pretrained(folder)
    save_word_tokenizer(folder, ["<unk>", "<pad>"] + [f"w{i}" for i in range(30)])
    code = main(["train-head", str(folder), "--feature", "--layout", "eagle3", "--out", str(tmp_path / "h")])
    err = capsys.readouterr().err
    assert code == 2 and "own answers" not in err, err
    assert "is not Llama-structured" in err.splitlines()[-1] and "use --layout joined" in err.splitlines()[-1], err


def expected_shapes(config, vocab_size: int, draft: int, biased: bool) -> dict[str, tuple[int, ...]]:
    """EAGLE-3's checkpoint: names and shapes, from the draft's config.json."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (draft, h), "d2t": (draft,),
              "t2d": (vocab_size,), "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
              "midlayer.post_attention_layernorm.weight": (h,),
              "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
              "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
              "midlayer.mlp.down_proj.weight": (h, i)}
    if biased:
        shapes.update({"midlayer.self_attn.q_proj.bias": (q,), "midlayer.self_attn.k_proj.bias": (kv,),
                       "midlayer.self_attn.v_proj.bias": (kv,), "midlayer.self_attn.o_proj.bias": (h,)})
    return shapes


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding of `x` `[heads, T, d]` at `positions` `[T]`."""
    d = x.shape[-1]
    angles = positions[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)  # [T, d / 2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


def eagle3_first_step(folder, model, tokens: list[int]) -> torch.Tensor:
    """The draft's log-probabilities `[T, V]` for the token after each position's next one, computed from the
    exported files alone, as an EAGLE-3 engine does; plus selfspec's entry for the first token (f = 0)."""
    w = {k: v.double() if v.is_floating_point() else v for k, v in load_file(str(folder / "model.safetensors")).items()}
    c = json.loads((folder / "config.json").read_text())
    eps, h, d = c["rms_norm_eps"], c["hidden_size"], c["head_dim"]
    with torch.no_grad():  # on a copy: transformers leaves hooks on the layers that record hidden states
        states = copy.deepcopy(model)(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # [0]: embedding
    f = w["fc.weight"] @ torch.cat([states[i][0].double() for i in c["eagle_aux_hidden_state_layer_ids"]], -1).T
    f = torch.cat([torch.zeros(1, h, dtype=torch.float64), f.T[:-1]])  # [T, h]: position p pairs f at p - 1
    emb = model.get_input_embeddings().weight[tokens].double()  # [T, h]
    x = torch.cat([rms(emb, w["midlayer.input_layernorm.weight"], eps), rms(f, w["midlayer.hidden_norm.weight"], eps)],
                  -1)  # [T, 2h]

    def proj(name: str, inputs: torch.Tensor) -> torch.Tensor:
        bias = w.get(f"midlayer.{name}.bias")
        return inputs @ w[f"midlayer.{name}.weight"].T + (0 if bias is None else bias)

    positions = torch.arange(len(tokens))
    q = proj("self_attn.q_proj", x).view(len(tokens), -1, d).transpose(0, 1)  # [heads, T, d]
    k = proj("self_attn.k_proj", x).view(len(tokens), -1, d).transpose(0, 1)
    v = proj("self_attn.v_proj", x).view(len(tokens), -1, d).transpose(0, 1)
    q, k = rotate(q, positions, c["rope_theta"]), rotate(k, positions, c["rope_theta"])
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scores = (q @ k.transpose(1, 2)) / d**0.5 + torch.triu(torch.full((len(tokens),) * 2, float("-inf")), 1)
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(len(tokens), -1)
    hidden = f + proj("self_attn.o_proj", attended)
    up = rms(hidden, w["midlayer.post_attention_layernorm.weight"], eps)
    gate = torch.nn.functional.silu(up @ w["midlayer.mlp.gate_proj.weight"].T)
    hidden = hidden + (gate * (up @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
    draft = rms(hidden, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [T, K]
    full = torch.full((len(tokens), c["vocab_size"]), float("-inf"), dtype=torch.float64)
    full[:, torch.arange(c["draft_vocab_size"]) + w["d2t"]] = draft  # target id = draft id + d2t
    return full.log_softmax(-1)


@pytest.mark.parametrize("arch, vocab", [("llama", True), ("qwen2", False)])
def test_the_export_has_eagle3s_names_and_shapes_and_computes_the_heads_draft(arch, vocab, tmp_path):
    model = tiny_model(arch, torch.float32)
    parts = model_parts(model)
    n = parts.num_layers
    # Qwen 2's last layers attend within a window here; its layer 0 does not (so the layout can say it).
    head = FeatureHead.from_model(parts, layout="eagle3", reads=(0, n // 2, n - 2), source_layer=0)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.1 * torch.randn_like(param))
    ids = load_vocab(make_vocab(model, tmp_path / "vocab"), 0, model=model, parts=parts).ids if vocab else None
    folder = export_eagle3(head, parts, model.config, tmp_path / "eagle3", vocab_ids=ids)
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    vocab_size = parts.lm_head.weight.shape[0]
    draft = vocab_size if ids is None else len(ids)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == draft and config["vocab_size"] == vocab_size
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, n // 2 + 1, n - 1]  # after layer r: id r + 1
    shapes = expected_shapes(config, vocab_size, draft, biased=arch == "qwen2")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert int(tensors["t2d"].sum()) == draft
    assert torch.equal(torch.nonzero(tensors["t2d"])[:, 0], (torch.arange(draft) + tensors["d2t"]).sort().values)
    assert transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "selfspec"}).hidden_size == \
        config["hidden_size"]

    tokens = random_prompt(12, seed=7)[0].tolist()
    runner = LayerRunner(parts, capacity=len(tokens), head=head)
    with torch.no_grad():
        out = unrolled_states(head, parts, runner, target_states(parts, tokens, head.reads), 1)[0]  # [1, T, hidden]
        logits = parts.lm_head(parts.norm(out))[0].double()  # [T, V]
    if ids is not None:
        allowed = torch.full_like(logits, float("-inf"))
        allowed[:, ids] = 0
        logits = logits + allowed
    torch.testing.assert_close(eagle3_first_step(folder, model, tokens), logits.log_softmax(-1), rtol=1e-4,
                               atol=1e-4)


def test_what_the_layout_cannot_say_is_refused(tmp_path):
    llama = tiny_model("llama")
    parts = model_parts(llama)
    n = parts.num_layers
    qwen3, mistral = model_parts(tiny_model("qwen3")), model_parts(tiny_model("mistral"))
    cases = [(FeatureHead.from_model(parts, reads=(0, 1, 2)), parts, "train it with --layout eagle3"),
             (FeatureHead.from_model(parts, reads=(0, 2), layout="eagle3"), parts, "reads 2 layers"),
             (FeatureHead.from_model(parts, reads=(0, 1, n - 1), layout="eagle3"), parts, "last layer's output"),
             (FeatureHead.from_model(qwen3, reads=(0, 1, 2), layout="eagle3"), qwen3, "k_norm"),
             (FeatureHead.from_model(mistral, reads=(0, 1, 2), layout="eagle3"), mistral, "sliding window")]
    for head, owner, reason in cases:
        problem = layout_problem(head, owner)
        assert problem is not None and reason in problem, (reason, problem)
    assert layout_problem(FeatureHead.from_model(parts, reads=(0, 1, 2), layout="eagle3"), parts) is None
    with pytest.raises(ValueError, match="cannot be written as EAGLE-3: its layout is 'joined'"):
        export_eagle3(cases[0][0], parts, llama.config, tmp_path / "x")


def test_train_and_export_from_the_command_line(tmp_path, capsys):
    words = ["<unk>", "<pad>"] + [f"w{i}" for i in range(30)]
    folder = tmp_path / "model"
    save_tiny_llama(folder, words, num_hidden_layers=6)
    head = tmp_path / "heads" / "f"
    assert main(["train-head", str(folder), "--feature", "--layout", "eagle3", "--reads", "0,2,4", "--prompts", "4",
                 "--new-tokens", "8", "--batch-size", "2", "--epochs", "1", "--minutes", "0.1", "--unroll", "2",
                 "--eval-fraction", "0.25", "--out", str(head)]) == 0
    assert json.loads((tmp_path / "heads" / "f.json").read_text())["layout"] == "eagle3"
    assert main(["export-head", str(folder), str(tmp_path / "heads" / "f.json"), "--out", str(tmp_path / "e3"),
                 "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert "reads as layer ids [1, 3, 5]" in printed and "vLLM" in printed, printed
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    trained = json.loads((tmp_path / "heads" / "f.json").read_text())["training"]["draft_vocab"]
    assert config["draft_vocab_size"] == trained["tokens"] and config["torch_dtype"] == "bfloat16"
    assert load_file(str(tmp_path / "e3" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    model, _ = selfspec.load(str(folder), dtype="float32")
    joined = make_feature_head(model, tmp_path / "joined", reads=(0, 2, 4))
    assert main(["export-head", str(folder), str(joined), "--out", str(tmp_path / "no")]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading progress
    assert error.startswith("selfspec export-head: ") and "its layout is 'joined'; train it with --layout eagle3" \
        in error, error
    spec = selfspec.wrap(model, plan=str(tmp_path / "heads" / "f.plan.json"))
    prompt = torch.tensor([[2, 5, 7, 5, 9]])
    assert torch.equal(spec.generate(prompt, max_new_tokens=12),
                       model.generate(prompt, do_sample=False, max_new_tokens=12))
