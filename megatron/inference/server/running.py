"""Running the server: uvicorn's server that reports its port and stops gracefully, and ``serve``,
which runs it with the scheduler until SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn

from megatron.inference.guard import Limits, is_loopback
from megatron.inference.scheduler import Scheduler
from megatron.inference.server.app import create_app
from megatron.inference.server.chat import ChatTemplate
from megatron.metrics import get_logger


class HTTPServer(uvicorn.Server):
    """uvicorn's server that reports the port it bound (``--port 0`` picks a free one) and, on
    SIGINT/SIGTERM, shuts down gracefully without re-raising the signal afterwards (uvicorn does, which
    would kill the process before the followers are told to stop)."""

    def __init__(self, app, host: str, port: int, on_ready=None, graceful_seconds: float = 5.0):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=graceful_seconds))
        self.port, self.on_ready = port, on_ready

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            self.port = self.servers[0].sockets[0].getsockname()[1]
            if self.on_ready is not None:
                self.on_ready(self.port)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(scheduler: Scheduler, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          limits: Limits | None = None, api_key: str | None = None, template: ChatTemplate | None = None) -> int:
    """Run the server until SIGINT/SIGTERM (or a fatal scheduler error); then stop the scheduler, which
    tells the other tensor-parallel ranks to stop. Exit status: 0, or 1 after a fatal error."""
    log = get_logger()
    if not api_key and not is_loopback(host):
        log.warning(f"serving on {host} without an API key: anyone who can reach this port can use the model; set "
                    "--api-key or MEGATRON_API_KEY (clients send it as 'Authorization: Bearer <key>').")
    server = HTTPServer(create_app(scheduler, model_name, limits, api_key, template), host, port,
                        on_ready=lambda bound: log.info(f"serving {model_name} on http://{host}:{bound} "
                                                        f"(tp {scheduler.tp})"))

    def fatal():
        server.should_exit = True

    scheduler.on_fatal = fatal
    scheduler.start()
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot listen, after logging why
        if server.started:
            raise
        raise OSError(f"cannot listen on {host}:{port} (the line above says why): choose another --port or --host.") \
            from None
    finally:
        scheduler.stop()
    if scheduler.error:  # already logged, with the reason
        log.error(f"stopped serving {model_name} after that error")
        return 1
    log.info(f"stopped serving {model_name}")
    return 0
