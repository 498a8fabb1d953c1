"""`probe serve`: a live page for one loaded model, and `show`, which serves it beside a notebook's kernel."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from probe.models import LoadedModel
from probe.serve.app import create_app, is_loopback, new_token
from probe.serve.views import Views

__all__ = ["Server", "create_app", "is_loopback", "new_token", "show", "start"]


@dataclass
class Server:
    """A running server: its address (with the token) and how to stop it."""

    url: str
    handle: Any  # uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        """Stop serving and the model's worker (the model is as it was: every request restores it)."""
        self.handle.should_exit = True
        self.thread.join(timeout=30)
        self.handle.config.app.state.worker.close()


def start(loaded: LoadedModel, *, host: str = "127.0.0.1", port: int | None = None, max_tokens: int = 2048,
          token: str | None = None) -> Server:
    """Serve `loaded` from a background thread (on loopback, a free port by default) and return once it listens."""
    import uvicorn

    token = token or new_token()
    if not port:  # a free one
        with socket.socket() as free:
            free.bind((host, 0))
            port = int(free.getsockname()[1])
    app = create_app(Views(loaded, max_tokens=max_tokens), token)
    handle = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=handle.run, name="probe-serve", daemon=True)
    thread.start()
    while not handle.started and thread.is_alive():
        time.sleep(0.05)
    return Server(f"http://{host}:{port}/?token={token}", handle, thread)


def show(loaded: LoadedModel, *, height: int = 900, **options: Any) -> Server:
    """Serve `loaded` beside the notebook's kernel and show the page inline (an IFrame); `server.stop()` ends it."""
    from IPython.display import IFrame, display

    server = start(loaded, **options)
    display(IFrame(server.url, width="100%", height=height))
    return server
