"""The `selfspec` command: every bad argument is one line naming the value and the valid range, exit 2, no
traceback, before any model loads; Ctrl-C exits 130; temperature 0 and top-p 0 mean greedy.

Bad arguments run in-process (fast, with `selfspec.load` replaced by a trap so a
model load fails the test) and a representative set also as real processes,
started together. Commands that need a model use a tiny random Llama saved
as a Hugging Face folder; nothing downloads.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import selfspec
from selfspec.cli import main
from selfspec.cli.generate import sampling_options
from selfspec.testing import save_tiny_llama

WORDS = ["[UNK]", "[PAD]", "hello", "world", "the", "capital", "of", "france", "is", "paris", "a", "cat"]
NO_MODEL = "/no/such/model"  # if a check ran after loading, the error would be about this instead


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A random 2-layer Llama with a long context (for the Ctrl-C test) and a word-level tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(folder, WORDS, max_position_embeddings=32768)
    return folder


@pytest.fixture
def no_model_load(monkeypatch):
    def trap(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(selfspec, "load", trap)


def bad_plan(tmp_path: Path) -> str:
    path = tmp_path / "plan.json"
    path.write_text('{"exit_layer": "2"}')
    return str(path)


# (arguments, text the one-line message must contain); paths under {tmp} are made by the test
BAD_ARGUMENTS = [
    (["generate", "--model", NO_MODEL, "--plan", "missing.json", "hi"], ["'missing.json'", "no such file"]),
    (["generate", "--model", NO_MODEL, "--plan", "{bad_plan}", "hi"], ["plan.json", "exit_layer", "'2'"]),
    (["generate", "--model", NO_MODEL, "--device", "junk", "hi"], ["--device", "'junk'", "valid here: cpu"]),
    (["generate", "--model", NO_MODEL, "--threads", "-1", "hi"], ["--threads", "-1", ">= 1"]),
    (["generate", "--model", NO_MODEL, "--threads", "0", "hi"], ["--threads", "0", ">= 1"]),
    (["generate", "--model", NO_MODEL, "--threads", "two", "hi"], ["--threads", "'two'", ">= 1"]),
    (["generate", "--model", NO_MODEL, "--temperature", "-0.5", "hi"], ["--temperature", "-0.5", ">= 0"]),
    (["generate", "--model", NO_MODEL, "--temperature", "nan", "hi"], ["--temperature", "'nan'", ">= 0"]),
    (["generate", "--model", NO_MODEL, "--top-p", "1.5", "hi"], ["--top-p", "1.5", "0..1"]),
    (["generate", "--model", NO_MODEL, "--max-new-tokens", "0", "hi"], ["--max-new-tokens", "0", ">= 1"]),
    (["generate", "--model", NO_MODEL, "--dtype", "int8", "hi"], ["--dtype", "'int8'", "float32"]),
    (["generate", "--model", NO_MODEL, "caf\udcff"], ["prompt", "b'caf\\xff'", "UTF-8"]),
    (["tune", NO_MODEL, "--budget", "0"], ["--budget", "0", ">= 1"]),
    (["tune", NO_MODEL, "--max-new-tokens", "1"], ["--max-new-tokens", "1", ">= 2"]),
    (["tune", NO_MODEL, "--data", "missing.txt"], ["--data", "'missing.txt'", "existing file"]),
    (["tune", NO_MODEL, "--data", "{not_utf8}"], ["prompts.txt", "UTF-8", "0xff"]),
    (["train-head", NO_MODEL, "--out", "o", "--exit-layer", "0"], ["--exit-layer", "0", ">= 1"]),
    (["train-head", NO_MODEL, "--out", "o", "--feature", "--exit-layer", "2"], ["--exit-layer", "not allowed"]),
    (["train-head", NO_MODEL, "--out", "o", "--feature", "--reads", "2,x"], ["--reads", "'2,x'", "2,15,27"]),
    (["train-head", NO_MODEL, "--out", "o"], ["--feature", "--exit-layer", "required"]),
    (["train-head", NO_MODEL, "--out", "o", "--exit-layer", "2", "--epochs", "0"], ["--epochs", "0", "> 0"]),
    (["train-head", NO_MODEL, "--out", "o", "--exit-layer", "2", "--eval-fraction", "1"],
     ["--eval-fraction", "1", "< 1"]),
    (["train-head", NO_MODEL, "--out", "o", "--exit-layer", "2", "--draft-length", "99"], ["--draft-length", "99"]),
    (["train-head", NO_MODEL, "--out", "o", "--exit-layer", "2", "--text", "{not_utf8}"], ["prompts.txt", "UTF-8"]),
    (["count-vocab", NO_MODEL, "--out", "o", "--batch-size", "0"], ["--batch-size", "0", ">= 1"]),
    (["count-vocab", NO_MODEL, "--out", "o", "--sequences", "nope.json"], ["--sequences", "'nope.json'"]),
]


def fill(args: list[str], tmp_path: Path) -> list[str]:
    not_utf8 = tmp_path / "prompts.txt"
    not_utf8.write_bytes(b"hello\ncaf\xff\n")
    return [a.format(bad_plan=bad_plan(tmp_path), not_utf8=not_utf8) if "{" in a else a for a in args]


def assert_one_line_error(code: int, stderr: str, needles: list[str], *, progress_before: bool = False) -> None:
    """Exit 2, no traceback, and the error in one line (the only one, unless progress lines came before it)."""
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 or progress_before, stderr
    assert "error:" in lines[-1] and not any("error" in line for line in lines[:-1]), stderr
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])


@pytest.mark.parametrize("args, needles", BAD_ARGUMENTS, ids=[" ".join(a[:1] + a[2:4]) for a, _ in BAD_ARGUMENTS])
def test_bad_argument_is_one_line_before_the_model_loads(args, needles, tmp_path, capsys, no_model_load):
    code = main(fill(args, tmp_path))
    assert_one_line_error(code, capsys.readouterr().err, needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_device_without_cuda(capsys, no_model_load):
    code = main(["generate", "--model", NO_MODEL, "--device", "cuda", "hi"])
    assert_one_line_error(code, capsys.readouterr().err, ["--device", "'cuda'", "not available", "valid here: cpu"])


# --------------------------------------------------------------------------- as real processes


def selfspec_process(args: list, stdout=subprocess.PIPE, preexec_fn=None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # several start at once on a small machine
    return subprocess.Popen([sys.executable, "-m", "selfspec.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                            env=env, preexec_fn=preexec_fn)


PROCESS_CASES = {  # the rest of BAD_ARGUMENTS behaves the same in-process and in a process
    "missing plan": (["generate", "--model", NO_MODEL, "--plan", "missing.json", "hi"], ["'missing.json'"]),
    "device junk": (["generate", "--model", NO_MODEL, "--device", "junk", "hi"], ["'junk'", "valid here"]),
    "non-UTF-8 prompt": (["generate", "--model", NO_MODEL, b"caf\xff"], ["b'caf\\xff'", "UTF-8"]),
    "exit layer 99": (["train-head", "{tiny}", "--out", "{tmp}/head", "--exit-layer", "99"],
                      ["--exit-layer", "99", "valid: 1..1"]),
    "feature reads out of range": (["train-head", "{tiny}", "--out", "{tmp}/head", "--feature", "--reads", "0,7"],
                                   ["--reads", "0,7", "valid with --feature", "0..1"]),
}


@pytest.fixture(scope="module")
def process_results(tiny_folder, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every case of PROCESS_CASES run as `python -m selfspec.cli`, all started at once."""
    tmp = tmp_path_factory.mktemp("cli")
    running = {}
    for name, (args, _) in PROCESS_CASES.items():
        args = [a.format(tiny=tiny_folder, tmp=tmp) if isinstance(a, str) else a for a in args]
        running[name] = selfspec_process(args)
    results = {}
    for name, process in running.items():
        _, stderr = process.communicate(timeout=300)
        results[name] = (process.returncode, stderr.decode("utf-8", "replace"))
    return results


@pytest.mark.parametrize("case", list(PROCESS_CASES))
def test_bad_argument_in_a_real_process(case, process_results):
    """Exit status 2 and one line from the process itself (the model loads only for the layer check)."""
    code, stderr = process_results[case]
    assert_one_line_error(code, stderr, PROCESS_CASES[case][1], progress_before=case.startswith(("exit", "feature")))
    assert "own answers" not in stderr  # train-head: refused before generating any text


def test_ctrl_c_prints_interrupted_and_exits_130(tiny_folder):
    # Ctrl-C as a terminal sends it: to a process that has not inherited "ignore SIGINT" (what a shell gives the
    # commands it starts in the background, pytest among them, and Python then keeps).
    process = selfspec_process(["generate", "--model", str(tiny_folder), "--max-new-tokens", "30000", "hello"],
                               stdout=subprocess.DEVNULL,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = b""
    deadline = time.monotonic() + 120
    while b"loaded" not in seen and time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        seen += line
    assert b"loaded" in seen, seen
    time.sleep(0.5)  # now generating
    process.send_signal(signal.SIGINT)
    stderr = (seen + process.stderr.read()).decode()
    assert process.wait(timeout=60) == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr


def test_ctrl_c_during_start_up_prints_interrupted_only(tiny_folder):
    """A Ctrl-C while torch and transformers import (before `main` once): "interrupted", exit 130, no traceback."""
    # -X importtime writes a line to stderr as each import ends: the first torch module's line means that the
    # import of torch is under way (it takes seconds), and Python handles SIGINT by then.
    process = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "selfspec.cli", "generate", "--model", str(tiny_folder),
         "--max-new-tokens", "30000", "hello"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = b""
    while not re.search(rb"\|\s+torch", seen):
        line = process.stderr.readline()
        assert line, seen.decode()[-2000:]
        seen += line
    process.send_signal(signal.SIGINT)
    stderr = (seen + process.stderr.read()).decode()
    assert process.wait(timeout=60) == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    # What makes that hold wherever the signal lands: the command's own module imports neither torch nor
    # transformers, so every heavy import happens inside `main`, which reports an interrupt in one line.
    probe = subprocess.run([sys.executable, "-c", "import sys, selfspec.cli; "
                            "print(sorted({'torch', 'transformers'} & set(sys.modules)))"],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "[]", probe


def test_serve_stops_a_running_stream_after_the_grace_period_on_sigint(tiny_folder):
    """`selfspec serve` and a stream of 30,000 tokens: SIGINT ends the stream properly and the process soon after."""
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = selfspec_process(["serve", str(tiny_folder), "--port", str(port), "--max-batch", "1",
                                "--shutdown-grace", "0.5"], stdout=subprocess.DEVNULL,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = b""
        while b"Uvicorn running" not in seen and b"Application startup complete" not in seen:
            line = process.stderr.readline()
            assert line, seen.decode()
            seen += line
        body = {"model": str(tiny_folder), "prompt": "hello", "max_tokens": 30000, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            events += [next(lines), next(lines)]  # generating
            signalled = time.monotonic()
            process.send_signal(signal.SIGINT)
            events += [line for line in lines if line]
        assert events[-1] == "data: [DONE]" and "shutting_down" in events[-2], events[-3:]
        assert process.wait(timeout=30) == 130
        assert time.monotonic() - signalled < 15
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    stderr = seen.decode() + process.stderr.read().decode()
    assert "Traceback" not in stderr, stderr


def test_truncated_weights_are_one_line(tiny_folder, tmp_path, capsys):
    folder = tmp_path / "truncated"
    folder.mkdir()
    for path in tiny_folder.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["generate", "--model", str(folder), "--max-new-tokens", "2", "hello"]) == 2
    stderr = capsys.readouterr().err
    assert_one_line_error(2, stderr, [str(folder), "truncated or damaged"], progress_before=True)


# --------------------------------------------------------------------------- greedy at temperature 0 / top-p 0


def test_sampling_options():
    greedy = {"do_sample": False}
    assert sampling_options(None, None) == greedy
    assert sampling_options(0.0, None) == greedy  # was temperature 1.0: `args.temperature or 1.0`
    assert sampling_options(None, 0.0) == greedy  # top-p 0 keeps only the most likely token
    assert sampling_options(0.0, 0.9) == greedy
    assert sampling_options(0.7, None) == {"do_sample": True, "temperature": 0.7, "top_p": 1.0}
    assert sampling_options(None, 0.9) == {"do_sample": True, "temperature": 1.0, "top_p": 0.9}


def test_temperature_0_and_top_p_0_generate_the_greedy_text(tiny_folder, capsys):
    def answer(*options: str) -> str:
        args = ["generate", "--model", str(tiny_folder), "--max-new-tokens", "24", "--seed", "3", *options,
                "hello world"]
        assert main(args) == 0
        return capsys.readouterr().out.split("\n\n")[0]

    greedy = answer()
    assert greedy.strip()
    assert answer("--temperature", "0") == greedy
    assert answer("--top-p", "0") == greedy
    assert answer("--temperature", "5") != greedy  # sampling at a high temperature does differ


# --------------------------------------------------------------------------- the training commands end to end


def test_own_answers_resume_an_interrupted_run(tiny_folder, tmp_path):
    """An earlier run's answers (same prompts and settings) are kept; only the rest are generated."""
    args = ["--prompts", "3", "--new-tokens", "5", "--batch-size", "2"]
    assert main(["count-vocab", str(tiny_folder), "--out", str(tmp_path / "a"), *args]) == 0
    text = json.loads((tmp_path / "a.sequences.json").read_text())
    made = text["sequences"]
    assert not (tmp_path / "a.answers-partial.json").exists()  # removed once the text is complete
    prompts = [s[: len(s) - len(a)] for s, a in zip(made, text["answers"])]
    marked = made[0][:-1] + [3]
    (tmp_path / "b.answers-partial.json").write_text(json.dumps(
        {"prompts": prompts, "new_tokens": 5, "sequences": [marked, made[1]]}))
    assert main(["count-vocab", str(tiny_folder), "--out", str(tmp_path / "b"), *args]) == 0
    resumed = json.loads((tmp_path / "b.sequences.json").read_text())["sequences"]
    assert resumed == [marked, made[1], made[2]]


def test_count_vocab_and_train_head_on_a_tiny_model(tiny_folder, tmp_path, capsys):
    common = ["--prompts", "4", "--new-tokens", "6", "--batch-size", "2"]
    assert main(["count-vocab", str(tiny_folder), "--out", str(tmp_path / "vocab"), *common]) == 0
    assert (tmp_path / "vocab.json").is_file() and (tmp_path / "vocab.sequences.json").is_file()
    out = tmp_path / "heads" / "e1"
    assert main(["train-head", str(tiny_folder), "--exit-layer", "1", "--epochs", "1", "--minutes", "0.2",
                 "--eval-fraction", "0.25", "--sequences", str(tmp_path / "vocab.sequences.json"),
                 "--out", str(out)]) == 0
    for suffix in (".json", ".safetensors", ".plan.json", "-vocab.json"):
        assert (out.parent / f"{out.name}{suffix}").is_file(), suffix
    features = tmp_path / "heads" / "features"
    assert main(["train-head", str(tiny_folder), "--feature", "--epochs", "1", "--minutes", "0.2", "--unroll", "3",
                 "--eval-fraction", "0.25", "--sequences", str(tmp_path / "vocab.sequences.json"),
                 "--out", str(features)]) == 0
    printed = capsys.readouterr().out
    assert "agreement per draft position" in printed and "mean accepted chain of 3" in printed, printed
    plan = json.loads((features.parent / "features.plan.json").read_text())
    trained = json.loads((features.parent / "features.json").read_text())["training"]
    assert plan["draft_vocab"] == "features-vocab.json"  # the head learned to draft from it
    assert (plan["ngram"], plan["recycle"], plan["tree"], plan["draft_length"]) == (3, True, 16, 8)  # behind copies
    assert trained["draft_vocab"]["file"] == "features-vocab.json" and trained["draft_vocab"]["tokens"] >= 1
    model, _ = selfspec.load(str(tiny_folder), dtype="float32")
    spec = selfspec.wrap(model, plan=str(features.parent / "features.plan.json"))
    prompt = torch.tensor([[1, 5, 7, 5, 9]])
    assert torch.equal(spec.generate(prompt, max_new_tokens=12),
                       model.generate(prompt, do_sample=False, max_new_tokens=12))
    # a saved sequences file whose ids the model does not have is refused before any training
    bad = tmp_path / "bad.sequences.json"
    bad.write_text('{"source": "x", "sequences": [[1, 2], [3, 999]], "answers": []}')
    code = main(["train-head", str(tiny_folder), "--exit-layer", "1", "--sequences", str(bad), "--out",
                 str(tmp_path / "h2")])
    assert_one_line_error(code, capsys.readouterr().err, ["999", f"0..{len(WORDS) - 1}"], progress_before=True)


def test_closed_stdout_ends_quietly(tiny_folder):
    """`selfspec generate ... | head -1`: the reader went away; no traceback, no error line."""
    process = selfspec_process(["generate", "--model", str(tiny_folder), "--max-new-tokens", "3000", "hello"])
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1, stderr
    assert "Traceback" not in stderr and "error" not in stderr, stderr


def test_tune_command_on_a_tiny_model(tiny_folder, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["tune", str(tiny_folder), "--prompts", "2", "--heldout", "1", "--max-new-tokens", "6",
                 "--budget", "3", "--confirm", "1", "--proxy-check", "0", "--no-plot", "--quiet",
                 "--out", str(out)]) == 0
    assert selfspec.DraftPlan.load(out).name == f"{tiny_folder.name}-float32-tuned"
    assert "selfspec tune" in capsys.readouterr().out and out.with_suffix(".tune.json").is_file()


def test_costs_command_on_a_tiny_model(tiny_folder, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    selfspec.DraftPlan(layers=[0], draft_length=3, ngram=2).save(plan)
    assert main(["costs", str(tiny_folder), "--plan", str(plan), "--dtype", "float32,bfloat16", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "verify pass over q tokens, in plain steps: 1:1.00 2:" in out and " 4:" in out  # widths 1..k+1
    assert "an n-gram copy pays when more than" in out and "draft step:" in out
    assert "the same with 1024 entries in the cache (not 48): 1:" in out
    assert "fastest plain step here:" in out


def test_costs_command_refuses_a_bad_dtype_before_loading(no_model_load, capsys):
    assert main(["costs", "--dtype", "float32,int8"]) == 2
    err = capsys.readouterr().err
    assert "'float32,int8'" in err and "float32, bfloat16, float16" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["generate", "hi"], ["costs"], ["count-vocab", "m", "--out", "x"]])
def test_verify_flag_reaches_load(monkeypatch, command, capsys):
    seen = {}

    def fake_load(name, **options):
        seen.update(options)
        raise ValueError("stopped after load was called")

    monkeypatch.setattr(selfspec, "load", fake_load)
    assert main([*command, "--verify"]) == 2
    assert seen.get("verify") is True and "stopped after load" in capsys.readouterr().err


def test_generate_compare_on_a_tiny_model(tiny_folder, capsys):
    assert main(["generate", "--model", str(tiny_folder), "--max-new-tokens", "12", "--compare", "hello there"]) == 0
    out = capsys.readouterr().out
    assert "model.generate:" in out and "outputs identical: yes" in out
    assert "costs: plain step" in out and "memory: weights" in out


def test_no_reproducible_reaches_wrap(tiny_folder, capsys, monkeypatch):
    """`generate` and `serve` wrap reproducibly unless told `--no-reproducible`."""
    from selfspec.cli import build_parser

    seen = []
    wrap = selfspec.wrap
    monkeypatch.setattr(selfspec, "wrap", lambda *a, **k: (seen.append(k["reproducible"]), wrap(*a, **k))[1])
    for flags in ([], ["--no-reproducible"]):
        assert main(["generate", "--model", str(tiny_folder), "--max-new-tokens", "4", *flags, "hi"]) == 0
    assert seen == [True, False]
    assert build_parser().parse_args(["serve", "m"]).reproducible is True
    assert build_parser().parse_args(["serve", "m", "--no-reproducible"]).reproducible is False


def test_generate_on_the_static_step(tiny_folder, capsys):
    args = ["generate", "--model", str(tiny_folder), "--max-new-tokens", "12", "--step", "static", "--compare", "hi"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "step: static" in out and "outputs identical: yes" in out


def test_kernels_reach_wrap_and_name_the_engines_choices(tiny_folder, capsys, monkeypatch):
    from selfspec.cli import build_parser, common
    from selfspec.kernel_choice import KERNEL_CHOICES

    assert common.KERNEL_CHOICES == KERNEL_CHOICES  # the CLI names them without importing torch
    seen = []
    wrap = selfspec.wrap
    monkeypatch.setattr(selfspec, "wrap", lambda *a, **k: (seen.append(k["kernels"]), wrap(*a, **k))[1])
    args = ["generate", "--model", str(tiny_folder), "--max-new-tokens", "8", "--kernels", "packed", "--compare", "hi"]
    assert main(args) == 0
    assert "outputs identical: yes" in capsys.readouterr().out and seen == ["packed"]
    assert build_parser().parse_args(["serve", "m"]).kernels == "measured"
    assert build_parser().parse_args(["serve", "m", "--kernels", "transformers"]).kernels == "transformers"


@pytest.mark.parametrize("command", [["generate", "hi"], ["costs"]])
def test_graphs_step_on_a_cpu_is_a_one_line_error_before_loading(monkeypatch, command, capsys):
    monkeypatch.setattr(selfspec, "load", lambda *a, **k: pytest.fail("loaded a model for a refused --step"))
    assert main([*command, "--step", "graphs"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--step graphs needs a CUDA device (got --device cpu" in err and len(err.splitlines()) == 1
