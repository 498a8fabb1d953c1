"""`probe serve`: a live page for one model, served from this machine until Ctrl-C."""

from __future__ import annotations

import webbrowser
from typing import Annotated, Optional

import typer

from probe.cli.options import Device, Dtype, MaxTokens, Model, TrustRemoteCode, load
from probe.cli.progress import console
from probe.errors import ProbeError
from probe.models import DEFAULT_MODEL

Host = Annotated[str, typer.Option("--host", help="Address to listen on; one other than loopback needs --token.")]
Port = Annotated[int, typer.Option("--port", help="Port to listen on.")]
Token = Annotated[Optional[str], typer.Option(
    "--token", envvar="PROBE_SERVE_TOKEN", help="The access token every request needs (default on loopback: a "
    "random one, printed with the address); also read from $PROBE_SERVE_TOKEN.")]
Open = Annotated[bool, typer.Option("--open", help="Open the page in the default browser.")]


def serve(
    model: Model = DEFAULT_MODEL, trust_remote_code: TrustRemoteCode = False, host: Host = "127.0.0.1",
    port: Port = 8765, device: Device = None, dtype: Dtype = "float32", max_tokens: MaxTokens = 2048,
    token: Token = None, open_page: Open = False,
) -> None:
    """Serve a live page for the model: type a text, see every head, click one to see where it attends, why (QK
    attribution), what it writes (DLA), and what the model does without it (ablation, scaling, generation)."""
    import uvicorn

    from probe.serve import create_app, is_loopback, new_token
    from probe.serve.views import Views

    if not is_loopback(host) and not token:
        raise ProbeError(f"--host {host} is reachable from other machines: give an access token with --token (or "
                         "$PROBE_SERVE_TOKEN)")
    if not 1 <= port <= 65535:
        raise ProbeError(f"--port must be 1-65535, got {port}")
    if max_tokens < 2:
        raise ProbeError(f"--max-tokens must be at least 2, got {max_tokens}")
    token = token or new_token()
    loaded = load(model, device, dtype, trust_remote_code=trust_remote_code)
    app = create_app(Views(loaded, max_tokens=max_tokens), token)
    address = f"http://{host if ':' not in host else f'[{host}]'}:{port}/?token={token}"
    console.print(f"serving {loaded.name}: open {address}", markup=False, highlight=False, soft_wrap=True)
    if open_page:
        webbrowser.open(address)
    uvicorn.run(app, host=host, port=port, log_level="warning")
    app.state.worker.close()
