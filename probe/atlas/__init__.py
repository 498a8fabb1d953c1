"""The atlas: one result, and one page, where every head's evidence meets (pattern, weights, cause).

    from probe.atlas import atlas
    result = atlas(loaded)              # probe.atlas.run.atlas
    result.to_dict()                    # the same JSON as `probe atlas --json`
"""

from probe.atlas.result import METRICS, Atlas, Stage
from probe.atlas.run import atlas

__all__ = ["METRICS", "Atlas", "Stage", "atlas"]
