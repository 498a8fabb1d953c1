"""Heads across training (Olsson et al. 2022): every head class's scores, the loss and the in-context learning score
of each checkpoint, and their phase changes; `probe track` is the command, docs/track.md the guide."""

from probe.track.checkpoints import Checkpoint, Run, check_run, find_run, load_checkpoints, read_state_dict, step_of
from probe.track.icl import IclScore, icl_score, probe_loss
from probe.track.result import MIN_RISE, CheckpointResult, TrackResult, best_scores, icl_change, phase_changes
from probe.track.run import TrackOptions, measure, read_track, track

__all__ = ["MIN_RISE", "Checkpoint", "CheckpointResult", "IclScore", "Run", "TrackOptions", "TrackResult",
           "best_scores", "check_run", "find_run", "icl_change", "icl_score", "load_checkpoints", "measure",
           "phase_changes", "probe_loss", "read_state_dict", "read_track", "step_of", "track"]
