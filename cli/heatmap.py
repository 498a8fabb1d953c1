"""`probe heatmap`: every head's attention on a text, as one interactive HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cli.main import (DeviceMapOption, DeviceOption, DtypeOption, ForceOption, ModelOption, OffloadOption, app,
                      errors, load)
from probe.errors import ProbeError


def parse_layers(spec: str | None) -> set[int] | None:
    """'0-3,10' -> {0, 1, 2, 3, 10}; None -> every layer."""
    if spec is None or not spec.strip():
        return None
    layers: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ProbeError(f"--layers takes numbers and ranges like 0-3,10; got {spec!r}") from None
        if low < 0 or high < low:
            raise ProbeError(f"--layers: {part.strip()!r} is not a range of layers")
        layers.update(range(low, high + 1))
    return layers


@app.command()
def heatmap(
    text: Optional[str] = typer.Option(None, "--text", help="The text to look at."),
    file: Optional[Path] = typer.Option(None, "--file", help="A UTF-8 text file to look at."),
    html_path: Path = typer.Option(..., "--html", help="The HTML page to write."),
    model: str = ModelOption,
    layers: Optional[str] = typer.Option(None, "--layers", help="Layers to include, e.g. 0-5,12 (default: all)."),
    max_tokens: int = typer.Option(512, "--max-tokens",
                                   help="Positions shown (at most 1024); a longer input is shown as a window."),
    window_start: int = typer.Option(0, "--window-start",
                                     help="First position of the window shown; the model still runs on all the "
                                          "tokens before it, so its queries see their whole context."),
    decimals: int = typer.Option(3, "--decimals", help="Decimals kept of each weight (1-4); 3 keeps pages small."),
    device: Optional[str] = DeviceOption,
    dtype: str = DtypeOption,
    device_map: Optional[str] = DeviceMapOption,
    offload_folder: Optional[Path] = OffloadOption,
    force: bool = ForceOption,
) -> None:
    """Draw every head's attention on a text: one head at a time, chosen on the page, with an overview of all."""
    from probe.patterns import read_text, text_patterns
    from reports.files import check_writable, write_text
    from reports.html import heatmap_page

    if (text is None) == (file is None):
        raise ProbeError("give the text with exactly one of --text TEXT or --file PATH")
    chosen = parse_layers(layers)
    check_writable(html_path, force=force)
    content = read_text(file) if file is not None else text
    source = f"text file {file}" if file is not None else "text given with --text"
    loaded = load(model, device, dtype, device_map, offload_folder)
    with errors.status("capturing attention ..."):
        patterns = text_patterns(loaded, content or "", source=source, layers=chosen, decimals=decimals,
                                 max_tokens=max_tokens, start=window_start)
    if patterns.note:
        errors.print(f"note: {patterns.note}", markup=False, highlight=False)
    page = heatmap_page(patterns)
    write_text(html_path, page)
    errors.print(f"wrote {html_path} ({len(page.encode('utf-8')) / 2**20:.1f} MiB, {len(patterns.tokens)} tokens)",
                 markup=False, highlight=False)
