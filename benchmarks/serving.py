"""The server part of benchmarks/generation.py: ``tools/serve.py`` started as a process and loaded by 1
and 16 concurrent HTTP clients (stdlib ``urllib``, so the figure is the server's, not a client library's).
Total completion tokens over wall time; skipped with a note when the server cannot start."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 directly, whatever *_proxy says


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    with _LOCAL.open(url, timeout=timeout) as response:
        return response.status, response.read()


def _post(url: str, body: dict, timeout: float) -> dict:
    """The JSON answer; an HTTP error is raised with the start of the server's message."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with _LOCAL.open(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise OSError(f"HTTP {err.code}: {err.read()[:300].decode(errors='replace')}") from None


def run_clients(url: str, shares: list[list[dict]], timeout: float) -> tuple[list, float]:
    """Send each share of request bodies from its own thread, one request after another; returns each
    request's (completion tokens, seconds) or its exception, and the wall time of the whole."""
    results: list[tuple[int, float] | BaseException] = []
    lock = threading.Lock()

    def client(share: list[dict]) -> None:
        for body in share:
            t0 = time.perf_counter()
            try:
                usage = _post(url, body, timeout)["usage"]["completion_tokens"]
                item: tuple[int, float] | BaseException = (int(usage), time.perf_counter() - t0)
            except Exception as err:  # reported by the caller, with the others
                item = err
            with lock:
                results.append(item)

    threads = [threading.Thread(target=client, args=(share,)) for share in shares]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def bench_server(args, ckpt: str, vocab: int) -> tuple[list[dict] | None, str]:
    """(rows, note): the throughput per client count, or None and why it was skipped."""
    serve = os.path.join(TOOLS, "serve.py")
    if not os.path.exists(serve):
        return None, "tools/serve.py does not exist yet"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile(mode="w+")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen([sys.executable, serve, "--load", ckpt, "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        ready, deadline = False, time.monotonic() + args.server_timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = _get(f"{base}/health", 2)[0] == 200
            except OSError:  # not listening yet (URLError is an OSError)
                pass
            if ready:
                break
            time.sleep(0.25)
        if not ready:
            log.seek(0)
            tail = " / ".join(log.read().strip().splitlines()[-3:])
            why = f"exited with status {proc.returncode}" if proc.poll() is not None else \
                f"not ready after {args.server_timeout:.0f} s"
            return None, f"tools/serve.py {why}" + (f" ({tail})" if tail else "")
        generator = torch.Generator().manual_seed(args.seed + 1)
        url = f"{base}/v1/completions"
        timeout = args.server_timeout * 10
        name = os.path.basename(os.path.normpath(ckpt))  # the server's default name, unless it lists another
        try:
            name = json.loads(_get(f"{base}/v1/models", 10)[1])["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError):
            pass

        def body() -> dict:
            ids = torch.randint(0, vocab, (args.prompt,), generator=generator).tolist()
            return {"model": name, "prompt": ids, "max_tokens": args.new, "temperature": 0.0, "ignore_eos": True}

        try:
            _post(url, body(), timeout)  # warm-up
        except (OSError, ValueError, KeyError) as err:
            return None, f"tools/serve.py did not answer a completion request ({err})"
        rows = []
        for clients in args.clients:
            total = max(clients, args.server_requests)
            bodies = [body() for _ in range(total)]
            results, wall = run_clients(url, [bodies[i::clients] for i in range(clients)], timeout)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                return None, f"tools/serve.py failed {len(errors)} of {total} requests ({errors[0]!r})"
            tokens = sum(r[0] for r in results)
            rows.append({"clients": clients, "requests": total, "tokens": tokens, "wall_s": wall,
                         "tps": tokens / wall, "latency_s": statistics.mean(r[1] for r in results)})
            print(f"  server, {clients} client(s): {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s",
                  flush=True)
        return rows, ""
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


if __name__ == "__main__":  # a module of benchmarks/generation.py, not a script of its own
    import argparse

    argparse.ArgumentParser(prog="serving.py", description=__doc__.split("\n\n")[0],
                            epilog="Not run on its own: python benchmarks/generation.py runs it.").parse_args()
    sys.exit("serving.py: nothing to run: python benchmarks/generation.py runs the server benchmark.")
