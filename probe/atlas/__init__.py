"""The atlas: one result, and one page, where every head's evidence meets (`atlas(loaded).to_dict()` is `probe atlas
--json`)."""

from probe.atlas.result import METRICS, Atlas, Stage
from probe.atlas.run import atlas

__all__ = ["METRICS", "Atlas", "Stage", "atlas"]
