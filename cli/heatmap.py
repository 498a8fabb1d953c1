"""`probe heatmap`: every head's attention on a text, as one interactive HTML page."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from probe.cli.options import (Device, DeviceMap, Dtype, Force, HtmlFile, JsonFile, MaxTokens, Model, OffloadFolder,
                               Text, TextFile, TrustRemoteCode, load)
from probe.cli.outputs import check_outputs
from probe.cli.progress import note, status
from probe.ablation.heads import parse_layers
from probe.hooks.layers import attention_layers
from probe.errors import ProbeError
from probe.models import DEFAULT_MODEL
from probe.inputs import read_text_file
from probe.patterns import text_patterns
from probe.reports.files import write_json, write_text
from probe.schemas import header
from probe.reports.labels import precision_sentence
from probe.reports.html import heatmap_page

Layers = Annotated[Optional[str], typer.Option(
    "--layers", help="Layers to include, e.g. 0-5,12; an encoder-decoder's by stack, e.g. enc0-2,x3 (default: all).")]
WindowStart = Annotated[int, typer.Option(
    "--window-start", help="First position of the window shown; the model still runs on all the tokens before it, "
    "so its queries see their whole context.")]
Decimals = Annotated[int, typer.Option("--decimals", help="Decimals kept of each weight (1-4); 3 keeps pages small.")]


def heatmap(
    html_path: HtmlFile = None, text: Text = None, file: TextFile = None, model: Model = DEFAULT_MODEL,
    trust_remote_code: TrustRemoteCode = False, layers: Layers = None, max_tokens: MaxTokens = 512,
    window_start: WindowStart = 0, decimals: Decimals = 3, device: Device = None, dtype: Dtype = "float32",
    device_map: DeviceMap = None, offload_folder: OffloadFolder = None, force: Force = False,
    json_path: JsonFile = None,
) -> None:
    """Draw every head's attention on a text: one head at a time, chosen on the page, with an overview of all."""
    if (text is None) == (file is None):
        raise ProbeError("give the text with exactly one of --text TEXT or --file PATH")
    if html_path is None and json_path is None:
        raise ProbeError("give --html PAGE, --json FILE or both: where to write what is captured")
    check_outputs({"--html": html_path, "--json": json_path}, force=force)
    content = read_text_file(file, parameter="file") if file is not None else text
    source = f"text file {file}" if file is not None else "text given with --text"
    loaded = load(model, device, dtype, device_map, offload_folder, trust_remote_code)
    chosen = parse_layers(layers, attention_layers(loaded.model))
    with status("capturing attention ..."):
        patterns = text_patterns(loaded, content or "", source=source, layers=chosen, decimals=decimals,
                                 max_tokens=max_tokens, start=window_start)
    if patterns.note:
        note(f"note: {patterns.note}")
    if json_path is not None:  # the shown heads' weights as plain JSON, for a script: the heatmap kind's payload
        write_json(json_path, patterns.to_dict(), schema=header("heatmap"))
        note(f"wrote {json_path} ({len(patterns.heads)} heads, {len(patterns.tokens)} tokens)")
    if html_path is not None:
        page = heatmap_page(patterns.page_payload())
        write_text(html_path, page)
        note(f"wrote {html_path} ({len(page.encode('utf-8')) / 2**20:.1f} MiB, {len(patterns.tokens)} tokens)")
    note(precision_sentence({"dtype": patterns.dtype}))  # what the weights were computed in, as every report says

