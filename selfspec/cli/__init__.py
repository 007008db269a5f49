"""The `selfspec` command: one dispatcher, one module per command.

    selfspec generate "Write a haiku about autumn"
    selfspec generate --compare "Write a haiku about autumn"   # also plain model.generate, same process
    selfspec tune smollm2-135m-instruct --out my_plan.json     # search a fast plan
    selfspec train-head smollm2-135m-instruct --exit-layer 8 --out heads/e8   # train an exit head
    selfspec count-vocab smollm2-135m-instruct --out heads/vocab              # count a draft vocabulary
    selfspec export-head smollm2-135m-instruct heads/f.json --out eagle3-f    # a head for vLLM / SGLang
    selfspec costs smollm2-135m-instruct                       # what a pass costs here, float32 and bfloat16
    selfspec serve smollm2-135m-instruct --port 8000           # an OpenAI-compatible HTTP server

Each command is a module of this package with `HELP` (one line),
`add_arguments(parser)` and `run(args) -> exit status`; adding a command is a
new module and one line in `COMMANDS`. Arguments are checked as they are
parsed, before any model loads. Every error is one line on stderr, exit status
2; Ctrl-C prints "interrupted" and exits 130; a closed stdout ends quietly
with 1.
"""

from __future__ import annotations

import importlib
import os
import sys

from .common import Parser

COMMANDS = {  # command -> its module in selfspec.cli
    "generate": "generate",
    "tune": "tune",
    "train-head": "train_head",
    "count-vocab": "count_vocab",
    "export-head": "export_head",
    "costs": "costs",
    "serve": "serve",
}
# What a command may raise for bad input or a bad environment: reported in one line. Anything else is a bug,
# and its traceback is the bug report.
ERRORS = (ValueError, OSError, ImportError, MemoryError)


def build_parser() -> Parser:
    parser = Parser(prog="selfspec", description="Self-speculative decoding, no second model.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"{__name__}.{module_name}")
        command = commands.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (0, 2 for an error, 130 when interrupted)."""
    prog = "selfspec"
    try:
        args = build_parser().parse_args(argv)
        prog = f"selfspec {args.command}"
        return args.run(args)
    except SystemExit as exit_:  # argparse: --help, or a bad argument (already reported in one line)
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`selfspec generate ... | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit does not fail again
        return 1
    except ERRORS as error:
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
