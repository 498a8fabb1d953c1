"""The atlas: one result, and one page, where every head's evidence meets (`probe atlas --json`)."""

from probe.atlas.result import METRICS, Atlas, Stage
from probe.atlas.run import atlas

__all__ = ["METRICS", "Atlas", "Stage", "atlas"]
