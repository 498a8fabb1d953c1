"""`probe schema [KIND]`: the published JSON Schema of a result file (docs/schemas.md), or the kinds there are."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from probe.schemas import SCHEMAS, kind_of

Kind = Annotated[Optional[str], typer.Argument(help="A result kind (classify, ablate, ...); none: list the kinds and "
                                                    "their versions.", show_default=False)]


def schema(kind: Kind = None) -> None:
    """Print the JSON Schema (draft 2020-12) of a result kind's --json file, or list the kinds with their versions.
    Every JSON file probe writes names its kind and version first ("schema": "probe/KIND", "schema_version": N)."""
    if kind is None:
        width = max(len(name) for name in SCHEMAS)
        for name, entry in sorted(SCHEMAS.items()):
            typer.echo(f"{name:<{width}}  v{entry.version}  {entry.description}")
        return
    typer.echo(json.dumps(kind_of(kind).schema(), indent=2))
