"""What the commands share: one-line errors, argument types that name the bad value and the valid range,
the options every command takes, and the prompt and training-text options.

Every argument is checked when it is parsed, before any model loads: a bad
value is one line, `selfspec COMMAND: error: argument --flag: VALUE ... (valid: RANGE)`,
exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16", "float64")
QUANTIZE_CHOICES = ("int8", "int4")  # selfspec.quant.QUANTIZE_CHOICES, without importing torch to parse arguments
KERNEL_CHOICES = ("measured", "packed", "transformers")  # selfspec.kernel_choice.KERNEL_CHOICES, likewise
BUDGET_CONTEXT = 1024  # selfspec.offload.BUDGET_CONTEXT, likewise


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line (no usage block): `PROG: error: MESSAGE`, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Interval:
    """An argument type for numbers in a range; the error names the value and the range."""

    def __init__(self, kind: type, low: float | None = None, high: float | None = None, *,
                 open_low: bool = False, open_high: bool = False) -> None:
        self.kind, self.low, self.high, self.open_low, self.open_high = kind, low, high, open_low, open_high

    def valid(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        low = None if self.low is None else ("> " if self.open_low else ">= ") + f"{self.low:g}"
        high = None if self.high is None else ("< " if self.open_high else "<= ") + f"{self.high:g}"
        if low and high and not (self.open_low or self.open_high):
            return f"{noun} in {self.low:g}..{self.high:g}"
        return " ".join([noun] + [" and ".join(b for b in (low, high) if b)]).strip()

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.valid()}") from None
        if self.kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not finite (valid: {self.valid()})")
        too_low = self.low is not None and (value <= self.low if self.open_low else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.open_high else value > self.high)
        if too_low or too_high:
            raise argparse.ArgumentTypeError(f"{text} out of range (valid: {self.valid()})")
        return value


def integer(low: int | None = None, high: int | None = None) -> Interval:
    return Interval(int, low, high)


def number(low: float | None = None, high: float | None = None, **open_ends: bool) -> Interval:
    return Interval(float, low, high, **open_ends)


def integer_list(value: str) -> tuple[int, ...]:
    """Comma-separated non-negative integers, e.g. "2,15,27"."""
    try:
        numbers = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of integers (e.g. 2,15,27)") from None
    if any(n < 0 for n in numbers):
        raise argparse.ArgumentTypeError(f"{value!r}: layer indices start at 0")
    return numbers


def text(value: str) -> str:
    """Text given on the command line, which must be valid UTF-8 (undecodable bytes arrive as surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raw = value.encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(
            f"{raw!r} is not valid UTF-8 (byte {raw[error.start]:#04x} at offset {error.start}; valid: UTF-8 text)"
        ) from None
    return value


def existing_file(value: str) -> str:
    value = text(value)
    if not Path(value).is_file():
        raise argparse.ArgumentTypeError(f"{value!r}: no such file (valid: the path to an existing file)")
    return value


def prompt_file(value: str) -> Path:
    """A prompt file, or 'spec-bench' (see `selfspec.prompts.prompt_file`)."""
    from ..prompts import prompt_file as find

    try:
        return find(text(value))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def device(value: str) -> str:
    """A torch device that works on this machine: `cpu`, `cuda`, `cuda:N`, `mps`, ..."""
    import torch

    value = text(value)
    available = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        available.append("mps")
    try:
        parsed = torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device (valid here: {', '.join(available)})") from None
    try:
        torch.empty(0, device=parsed)
    except (RuntimeError, AssertionError):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not available on this machine (valid here: {', '.join(available)})"
        ) from None
    return value


def add_runtime_arguments(parser: argparse.ArgumentParser, *, dtype: str | None = "float32") -> None:
    """--device, --threads, --verify, --quantize and (unless `dtype` is None) --dtype."""
    if dtype is not None:
        parser.add_argument("--dtype", default=dtype, choices=DTYPES, help=f"the model's dtype (default: {dtype})")
    parser.add_argument("--device", default="cpu", type=device, help="torch device (default: cpu)")
    parser.add_argument("--threads", type=integer(1), default=None,
                        help="torch CPU threads (default: torch's choice; on a busy shared machine 1 is often fastest)")
    parser.add_argument("--verify", action="store_true",
                        help="kept for compatibility: every load checks the converted model cache's full hash "
                             "(rebuilt if damaged)")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                        help="quantize the model's linear layers weight-only after loading (torchao; "
                             "pip install 'selfspec[quant]'); default: no quantization")


def size(value: str) -> str:
    """A byte size: "300MiB", "1.5GB" or bytes (checked here, parsed by `selfspec.offload.parse_bytes`)."""
    from ..offload import parse_bytes

    try:
        parse_bytes(text(value))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text(value)


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    """--max-memory and --offload-folder: what `selfspec.load` places outside fast memory."""
    parser.add_argument("--max-memory", type=size, default=None, metavar="SIZE",
                        help="a budget of fast memory (such as 300MiB): room for a generation's working set first, "
                             "then embeddings, LM head and norms, then as many layers as fit; the rest offloaded (to "
                             "disk on the CPU, to CPU memory behind a GPU), and the draft reads resident weights only")
    parser.add_argument("--budget-context", type=int, default=BUDGET_CONTEXT, metavar="N",
                        help="positions --max-memory keeps a working set for: the KV cache, a prefill's activations "
                             f"and a verify pass's logits (default {BUDGET_CONTEXT})")
    parser.add_argument("--offload-folder", default=None, metavar="DIR",
                        help="where offloaded weights go on disk (default: under the model cache)")


def offload_options(args: argparse.Namespace) -> dict:
    """`selfspec.load` keyword arguments for --max-memory, --budget-context and --offload-folder."""
    if not args.max_memory:
        return {}
    return {"max_memory": args.max_memory, "offload_folder": args.offload_folder, "budget_context": args.budget_context}


STEPS = ("auto", "eager", "static", "graphs")


def add_step_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--step", choices=STEPS, default="auto",
                        help="how passes run: auto (CUDA graphs on a GPU, eager elsewhere), eager, static "
                             "(fixed shapes, one read back per round), graphs (static + CUDA graphs; CUDA only)")
    parser.add_argument("--kernels", choices=KERNEL_CHOICES, default="measured",
                        help="the CPU's kernels: measured (the fastest here), packed (those and oneDNN on packed "
                             "copies of the weights where faster: wide passes cost little more than narrow ones, "
                             "the weights' memory twice), transformers (its own functions)")


def add_reproducible_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-reproducible", dest="reproducible", action="store_false",
                        help="refine the cost table from every round's timings and learn across requests "
                             "(`wrap(reproducible=False)`); by default the drafts depend on the input and the "
                             "cached cost table alone, so the same greedy input gives the same output every time")


def check_step(step: str, device: str) -> None:
    """`--step graphs` needs `--device cuda`: said before a model is loaded."""
    if step == "graphs" and not device.startswith("cuda"):
        raise ValueError(f"--step graphs needs a CUDA device (got --device {device}; valid here: --step auto, "
                         "eager or static)")


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def prompt_texts(data: Path | None, *, seed: int) -> list[str]:
    """The prompts of `--data` (a file `prompt_file` found), or the built-in chat prompts; in a seeded order."""
    from ..prompts import builtin_prompts, read_prompts

    return read_prompts(data, seed=seed) if data else builtin_prompts(seed=seed)


def read_text_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                         f"{error.start}; valid: a UTF-8 text file)") from None


# --------------------------------------------------------------------------- training text (train-head, count-vocab)


def add_text_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the text a head or a vocabulary learns from: its own answers to prompts, and a text file."""
    parser.add_argument("model", type=text, help="known model name (e.g. smollm2-135m-instruct) or a local model folder")
    parser.add_argument("--data", metavar="FILE", type=prompt_file,
                        help="prompts (.jsonl / .json / one a line; 'spec-bench' finds the Spec-Bench questions); "
                             "default: the built-in prompts")
    parser.add_argument("--prompts", type=integer(1), default=None, metavar="N",
                        help="use the first N prompts (default: all)")
    parser.add_argument("--text", metavar="FILE", type=existing_file,
                        help="also learn from this text file (cut into sequences)")
    parser.add_argument("--new-tokens", type=integer(1), default=128, help="answer length per prompt (default: 128)")
    parser.add_argument("--max-length", type=integer(2), default=768, help="longest training sequence (default: 768)")
    parser.add_argument("--batch-size", type=integer(1), default=8, help="prompts generated at once (default: 8)")
    add_runtime_arguments(parser, dtype=None)
    parser.add_argument("--seed", type=integer(0), default=0)
    parser.add_argument("--sequences", metavar="FILE", type=existing_file,
                        help="reuse the token sequences an earlier run saved (OUT.sequences.json) "
                             "instead of generating them")
    parser.add_argument("--out", required=True, type=text, help="output path without suffix")


@dataclass(frozen=True)
class TextInputs:
    """What `--data` and `--text` hold, read before the model loads so that a bad file fails first."""

    prompts: list[str] | None  # the prompts to answer (None with --sequences)
    text: str | None  # the --text file's contents


def read_text_inputs(args: argparse.Namespace) -> TextInputs:
    if Path(args.out).is_dir():
        raise ValueError(f"--out {args.out!r} is a folder (valid: a path without suffix, e.g. heads/smollm2-e8)")
    if args.sequences:
        return TextInputs(None, None)
    return TextInputs(prompt_texts(args.data, seed=args.seed), read_text_file(args.text) if args.text else None)


def load_float32(args: argparse.Namespace):
    """(model in float32 on `--device`, tokenizer, the model's parts)."""
    import selfspec
    from ..registry import model_parts

    set_threads(args.threads)
    model, tokenizer = selfspec.load(args.model, dtype="float32", device=args.device, verify=args.verify,
                                     quantize=args.quantize)
    return model, tokenizer, model_parts(model)


def training_text(args: argparse.Namespace, inputs: TextInputs, model, tokenizer, parts):
    """The `TrainingText` of `args`: read back from `--sequences`, or generated and saved to `OUT.sequences.json`."""
    from tqdm.auto import tqdm

    from ..prompts import encode_prompts
    from ..training import TrainingText, own_answers, text_sequences

    vocab_size = parts.lm_head.weight.shape[0]
    if args.sequences:
        return TrainingText.load(args.sequences, vocab_size=vocab_size)

    texts = inputs.prompts[: args.prompts] if args.prompts else inputs.prompts
    prompts = [ids[-args.max_length // 2 :] for ids in encode_prompts(tokenizer, texts)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # An interrupted run's answers, when it had the same prompts and settings, are kept and the rest generated.
    partial = out.parent / f"{out.name}.answers-partial.json"
    key = {"prompts": prompts, "new_tokens": args.new_tokens}
    done = []
    if partial.is_file():
        saved = json.loads(partial.read_text(encoding="utf-8"))
        if {k: saved.get(k) for k in key} == key:
            done = saved["sequences"]
    with tqdm(total=len(prompts), desc="own answers", unit="prompt", file=sys.stderr) as bar:
        sequences = own_answers(model, tokenizer, prompts, new_tokens=args.new_tokens, batch_size=args.batch_size,
                                progress=bar.update, done=done,
                                save=lambda made: partial.write_text(json.dumps({**key, "sequences": made})))
    answers = [seq[len(p):] for seq, p in zip(sequences, prompts)]
    source = f"{len(prompts)} prompts from {args.data or 'the built-in set'}, {args.new_tokens}-token greedy answers"
    if inputs.text is not None:
        extra = text_sequences(tokenizer, inputs.text, length=args.max_length)
        sequences += extra
        answers += extra
        source += f", and {args.text}"
    result = TrainingText([s[: args.max_length] for s in sequences], answers, source)
    result.save(out.parent / f"{out.name}.sequences.json")
    partial.unlink(missing_ok=True)
    return result
