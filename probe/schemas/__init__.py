"""The published JSON schemas of probe's result files: one `Kind` per kind in SCHEMAS (`probe schema KIND`)."""

from probe.schemas.base import DRAFT, SCHEMAS, Field, Kind, header, kind_of, object_schema

__all__ = ["DRAFT", "SCHEMAS", "Field", "Kind", "header", "kind_of", "object_schema"]
