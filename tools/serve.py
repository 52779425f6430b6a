"""Serve a checkpoint over an OpenAI-compatible HTTP API, batching concurrent requests.

    python tools/serve.py --load output/run --port 8000
    torchrun --nproc-per-node 2 tools/serve.py --load output/run --tp 2 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "run", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'

Endpoints: ``POST /v1/completions`` (OpenAI's legacy completions, with ``stream``; any number of prompts),
``POST /v1/chat/completions``, ``GET /v1/models[/ID]``, vLLM's ``GET /tokenizer_info``, ``POST /tokenize`` and
``POST /detokenize`` (so lm-eval's ``local-completions`` needs no tokenizer of its own), ``GET /health``; see
docs/inference.md. Needs the ``[serve]`` extra (``pip install -e ".[serve]"``).
Under torchrun, rank 0 serves HTTP and the other ranks run each batch with it. Logs
``serving MODEL on http://HOST:PORT (tp N)`` when ready (``--port 0``: a free port, shown there);
SIGINT/SIGTERM stop it. Exit status 2, with a one-line message, for a missing extra, a missing or
damaged checkpoint or a bad flag; 1 after a fatal error while serving. With ``--api-key`` (or the
``MEGATRON_API_KEY`` environment variable, which keeps the key out of ``ps``) every request but
``GET /health`` must send ``Authorization: Bearer <key>``; listening beyond the loopback without a
key logs a warning.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint import CheckpointError  # noqa: E402
from megatron.inference.guard import API_KEY_ENV, Limits  # noqa: E402
from megatron.inference.launch import add_model_arguments, build_engine, describe  # noqa: E402
from megatron.inference.scheduler import Scheduler, follow  # noqa: E402
from megatron.metrics import get_logger  # noqa: E402

PROG = "serve.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface).")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (0: any free port).")
    g.add_argument("--max-batch-size", type=int, default=32,
                   help="Rows (prompts) generated together; requests that arrive meanwhile join the next batch.")
    g.add_argument("--model-name", default=None,
                   help="The name clients give as 'model' (default: the checkpoint folder's name).")
    g.add_argument("--api-key", default=None,
                   help=f"Require 'Authorization: Bearer KEY' on every request but GET /health (default: the "
                   f"{API_KEY_ENV} environment variable; neither: no key).")
    limits = Limits()
    g.add_argument("--max-request-bytes", type=int, default=limits.max_request_bytes,
                   help="A larger request body is refused (413) before it is read.")
    g.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings,
                   help="Stop strings a request may give.")
    g.add_argument("--max-stop-chars", type=int, default=limits.max_stop_chars,
                   help="Characters a stop string may have.")
    g.add_argument("--max-prompts", type=int, default=limits.max_prompts,
                   help="Prompts one completions request may hold (run --max-batch-size at a time).")
    g.add_argument("--max-request-tokens", type=int, default=limits.max_request_tokens,
                   help="Tokens one request may ask for: its prompts' tokens plus max_tokens for each prompt.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    name = args.model_name or os.path.basename(os.path.normpath(args.load))
    try:
        if args.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be at least 1, got {args.max_batch_size}.")
        limits = Limits(args.max_request_bytes, args.max_stop_strings, args.max_stop_chars, args.max_prompts,
                        args.max_request_tokens)
        limits.check()
        api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
        from megatron.inference import server  # the [serve] extra: checked on every rank, before any collective

        engine = build_engine(args)
        template = server.chat_template(engine.tokenizer)  # on every rank: a bad one stops them all
        if rank != 0:
            # rank 0 tells this rank when to stop (the None batch); dying on torchrun's forwarded signal
            # first would leave rank 0's last broadcast without a receiver.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                follow(engine)
            except RuntimeError as err:  # rank 0 is gone: its log says why
                get_logger().error(f"rank {rank}: stopped: lost rank 0 ({type(err).__name__}); see rank 0's log.")
                return 1
            return 0
        get_logger().info(describe(engine, args.load))
        return server.serve(Scheduler(engine, args.max_batch_size), name, args.host, args.port, limits, api_key,
                            template)
    except (ImportError, ValueError, OSError, CheckpointError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
