"""The published JSON schemas of probe's result files (draft 2020-12): one `Kind` per kind in SCHEMAS (`probe schema
KIND`); every JSON file probe writes starts with its `header(kind)`."""

from probe.schemas import kinds as _kinds  # noqa: F401  (registers the kinds)
from probe.schemas.base import DRAFT, SCHEMAS, Field, Kind, header, kind_of, object_schema, register

__all__ = ["DRAFT", "SCHEMAS", "Field", "Kind", "header", "kind_of", "object_schema", "register"]
