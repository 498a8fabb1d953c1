"""The published JSON schemas of probe's result files (draft 2020-12): one `Kind` per kind in SCHEMAS (`probe schema
KIND`); every JSON file probe writes starts with its `header(kind)`."""

from probe.schemas.base import DRAFT, SCHEMAS, Field, Kind, header, kind_of, object_schema

__all__ = ["DRAFT", "SCHEMAS", "Field", "Kind", "header", "kind_of", "object_schema"]
