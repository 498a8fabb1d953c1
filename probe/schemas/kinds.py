"""The published kinds, each declared on its result class (probe.schemas.declare) and listed in DECLARED."""

from __future__ import annotations

DECLARED = (
    "probe.heads.classify:Classification",
    "probe.ablation.results:AblationResult",
    "probe.dla:Attribution",
    "probe.patching.heads:PatchResult",
    "probe.kv.result:KVHeads",
    "probe.kv.result:KVBudget",
    "probe.headvis.result:HeadVisMetrics",
    "probe.selfrepair:SelfRepair",
    "probe.ablation.prune:PruneResult",
    "probe.syntax.result:SyntaxResult",
    "probe.circuits.pairs:Circuits",
    "probe.qk:QKAttribution",
    "probe.headmaps.compare:Comparison",
    "probe.track.result:TrackResult",
    "probe.atlas.result:Atlas",
    "probe.steering:SteerResult",
    "probe.patterns:Patterns",
)
"""The result classes that declare their kind (`module:Class`), imported when the registry is first read."""
