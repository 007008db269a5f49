"""`selfspec serve`: an OpenAI-compatible HTTP server on the engine's public API (a tool, like `cli/`).

    from selfspec.serving import create_app
    app = create_app(selfspec.wrap(model), tokenizer, model_name="my-model")   # a FastAPI app
    uvicorn.run(app, host="127.0.0.1", port=8000)

`app.py`: the HTTP API (FastAPI + pydantic); `scheduler.py`: the bounded
queue and the worker thread that runs one request at a time; `generation.py`:
one request as one `spec.generate` call (streamer, stop strings,
cancellation); `metrics.py`: Prometheus metrics. Needs the `serve` extra:
`pip install 'selfspec[serve]'`.
"""

from __future__ import annotations

import importlib.util

REQUIREMENTS = ("fastapi", "uvicorn", "prometheus_client", "pydantic")
INSTALL = "pip install 'selfspec[serve]'"


def check_dependencies() -> None:
    """Raise ImportError, in one line naming the install command, when a serving dependency is missing."""
    missing = [name for name in REQUIREMENTS if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"selfspec serve needs {', '.join(missing)} (not installed): {INSTALL}")


def create_app(spec, tokenizer, **options):
    """The FastAPI app serving `spec`; see `selfspec.serving.app.create_app`."""
    check_dependencies()
    from .app import create_app as _create_app

    return _create_app(spec, tokenizer, **options)


__all__ = ["check_dependencies", "create_app", "INSTALL"]
