"""``bagserve serve`` and ``bagserve openapi``: the service, and its description."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["openapi_document", "register"]


def _cmd_serve(args: argparse.Namespace) -> int:
    from ..service.worker_server import start_worker_server

    # First: the workers' server imports scipy and the estimators (seconds) while this
    # process imports the web framework; the workers are forked from it, ready at once.
    start_worker_server()
    import uvicorn

    from ..service.app import create_app
    from ..service.settings import Settings

    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "workers": args.workers,
            "models_dir": args.models,
        }.items()
        if v is not None
    }
    settings = Settings(**overrides)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # The app routes uvicorn's loggers to its own handler (JSON when asked);
        # uvicorn's default configuration would put plain-text lines beside them.
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    return 0


def openapi_document() -> dict[str, Any]:
    """The service's OpenAPI description, as ``openapi/openapi.json`` holds it."""
    from ..service.app import create_app
    from ..service.settings import Settings

    return create_app(Settings()).openapi()


def _cmd_openapi(args: argparse.Namespace) -> int:
    text = json.dumps(openapi_document(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``bagserve`` parser's subcommands."""
    s = sub.add_parser("serve", help="serve the models over HTTP (settings: BAGSERVE_* variables)")
    s.add_argument("--host", help="default: BAGSERVE_HOST or 127.0.0.1")
    s.add_argument("--port", type=int, help="default: BAGSERVE_PORT or 8000")
    s.add_argument("--workers", type=int, help="compute processes; default: BAGSERVE_WORKERS or 2")
    s.add_argument("--models", help="models directory; default: BAGSERVE_MODELS_DIR or ./models")
    s.set_defaults(func=_cmd_serve)

    o = sub.add_parser("openapi", help="print (or write) the service's OpenAPI document")
    o.add_argument("--output", help="e.g. openapi/openapi.json")
    o.set_defaults(func=_cmd_openapi)
