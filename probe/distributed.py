"""Sharded sweeps under torchrun: each process runs a share of the sweep's chunks on its own device, streaming to its
own shard file, and rank 0 gathers and writes the one results file, equal to a single-process sweep exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from probe.ablation import AblationResult, Head, HeadResult, read_results, sweep
from probe.ablation.heads import ablation_list, distinct
from probe.ablation.runners import assign_chunks
from probe.ablation.stream import write_stream
from probe.inputs import ProbeSet
from probe.errors import ProbeError, first_line
from probe.models import DeviceMap, LoadedModel, input_device, parse_device_map

__all__ = ["Rank", "assign_chunks", "current", "process_group", "rank_device", "rank_placement", "shard_path",
           "shard_paths", "sharded_sweep"]

TIMEOUT = timedelta(hours=float(os.environ.get("PROBE_DIST_TIMEOUT_HOURS", "168")))  # the slowest share: hours later


@dataclass(frozen=True)
class Rank:
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current() -> Rank | None:
    """This process's rank from torchrun's environment, or None when run alone (a job of one process too)."""
    env = os.environ
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env["RANK"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise ProbeError("WORLD_SIZE, RANK and LOCAL_RANK must be integers (they are set by torchrun)") from None
    if world <= 1:
        return None
    if not 0 <= rank < world or not 0 <= local_rank < local_world:
        raise ProbeError(f"RANK {rank} / LOCAL_RANK {local_rank} out of range for WORLD_SIZE {world} / "
                         f"LOCAL_WORLD_SIZE {local_world}")
    return Rank(rank, world, local_rank, local_world)


def rank_device(rank: Rank | None, device: str | None) -> str | None:
    """The device of this process's model: its own GPU (cuda:LOCAL_RANK) unless `device` names one exactly."""
    if rank is None or not torch.cuda.is_available():
        return device
    count = torch.cuda.device_count()
    if device is None or device == "cuda":
        return f"cuda:{rank.local_rank % count}"
    return device


def rank_placement(rank: Rank | None, device_map: DeviceMap | None, offload_folder: str | Path | None
                   ) -> tuple[DeviceMap | None, Path | None, dict[int | str, int] | None]:
    """(device map, offload folder, max_memory) of this process: its GPUs (a map's indices within them), its share."""
    folder = None if offload_folder is None else Path(offload_folder)
    parsed = parse_device_map(device_map)
    if rank is None or parsed is None:
        return parsed, folder, None
    if folder is not None:
        folder = folder / f"rank-{rank.rank}"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per = count // rank.local_world_size  # the LOCAL_WORLD_SIZE processes split the node's GPUs into equal groups
    if count and not per:
        raise ProbeError(f"torchrun started {rank.local_world_size} processes on this machine, which has {count} "
                         f"GPU{'s' if count > 1 else ''}: a model split with device_map needs at least one GPU per "
                         f"process (use torchrun --nproc-per-node {count} or fewer)", parameter="device_map")
    gpus = list(range(rank.local_rank * per, (rank.local_rank + 1) * per))
    if isinstance(parsed, str):
        from accelerate.utils import get_max_memory

        available = get_max_memory()
        memory: dict[int | str, int] = {gpu: int(available[gpu]) for gpu in gpus if gpu in available}
        if "cpu" in available:
            memory["cpu"] = int(available["cpu"]) // rank.local_world_size
        return parsed, folder, memory
    remapped: dict[str, int | str] = {}
    for name, device in parsed.items():
        if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
            index = device if isinstance(device, int) else int(device.partition(":")[2] or 0)
            if not gpus:
                raise ProbeError(f"device_map puts {name!r} on GPU {index}, but this machine has no GPU: "
                                 "use cpu and disk", parameter="device_map")
            if index >= len(gpus):
                raise ProbeError(f"device_map puts {name!r} on GPU {index}, but under torchrun each of the "
                                 f"{rank.local_world_size} processes on this machine has {len(gpus)} GPU(s), "
                                 f"numbered 0-{len(gpus) - 1} within its group", parameter="device_map")
            remapped[name] = gpus[index]
        else:
            remapped[name] = device
    return remapped, folder, None


@contextmanager
def process_group(device: torch.device | str | None = None) -> Iterator[Rank | None]:
    """torch.distributed's default group for the `with`, yielding this Rank (None alone); an existing one is kept."""
    rank = current()
    if rank is None:
        yield None
        return
    import torch.distributed as dist

    if dist.is_initialized():
        yield rank
        return
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    except (RuntimeError, ValueError) as error:
        first = first_line(error) or type(error).__name__
        raise ProbeError(f"cannot join the torchrun job: {first}") from error
    try:
        yield rank
    finally:
        dist.destroy_process_group()


def gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


RANK_SUFFIX = re.compile(r"[0-9]+")  # after `.shard-`: the rank, in ASCII digits


def shard_path(results_path: str | Path, rank: int) -> Path:
    """Where process `rank` streams its share: `<results file>.shard-<rank>`, next to the results file."""
    path = Path(results_path)
    return path.with_name(f"{path.name}.shard-{rank}")


def shard_paths(results_path: str | Path) -> list[Path]:
    """Every shard file of a results file that this machine sees, any world size, in rank order."""
    path = Path(results_path)
    found = []
    for candidate in path.parent.glob(f"{path.name}.shard-*"):
        suffix = candidate.name.rpartition(".shard-")[2]
        if RANK_SUFFIX.fullmatch(suffix):  # not str.isdigit: '²' passes it and int() refuses it
            found.append((int(suffix), candidate))
    return [candidate for _, candidate in sorted(found)]


def _finished(results_path: Path) -> tuple[dict[str, Any] | None, list[HeadResult], list[str]]:
    """(header, finished ablations, files read) of the results file and its shards that this process sees."""
    header: dict[str, Any] | None = None
    entries: list[HeadResult] = []
    read: list[str] = []
    for path in [results_path, *shard_paths(results_path)]:
        if not path.is_file() or path.stat().st_size == 0:
            continue
        file_header, results = read_results(path)
        if header is not None and file_header.get("fingerprint") != header.get("fingerprint"):
            raise ProbeError(f"cannot resume: {path} holds a different sweep (model, data or method) than {read[0]}; "
                             "remove the stale file or start over without resume", parameter="resume")
        header = header or file_header
        entries.extend(results)
        read.append(str(path))
    return header, entries, read


def _share_finished(results_path: Path, mine: Path) -> None:
    """Pool what every process sees into this process's shard, so the rank owning a finished chunk skips it."""
    header, entries, read = _finished(results_path)
    pooled = gather((header, [entry.to_dict() for entry in entries], read))
    headers = [(h, files) for h, _, files in pooled if h is not None]
    if not headers:
        return
    first, first_files = headers[0]
    for other, files in headers[1:]:
        if other.get("fingerprint") != first.get("fingerprint"):
            raise ProbeError(f"cannot resume: {files[0]} and {first_files[0]} hold different sweeps (model, data or "
                             "method); remove the stale files or start over without resume", parameter="resume")
    write_stream(mine, first, _merged(found for _, found, _ in pooled))


def _merged(entry_lists: Any) -> list[HeadResult]:
    """Entries (as to_dict wrote them) of several processes, the first of each ablation kept."""
    return distinct((HeadResult.from_dict(entry) for entries in entry_lists for entry in entries),
                    key=lambda result: result.heads)


def _alone(loaded: LoadedModel, probe_set: ProbeSet, heads: Sequence[Head] | None, results_path: Path,
           resume: bool, **options: Any) -> AblationResult:
    """`sweep` in one process; resuming what a torchrun job left, its shards are pooled into the results file."""
    shards = shard_paths(results_path) if resume else []
    if shards:
        header, entries, _ = _finished(results_path)
        if header is not None:
            write_stream(results_path, header, distinct(entries, key=lambda result: result.heads))
    result = sweep(loaded, probe_set, heads, results_path=results_path, resume=resume, **options)
    for shard in shards:
        shard.unlink(missing_ok=True)
    return result


def _gathered(result: AblationResult, ablations: list[Any]) -> tuple[dict[Any, HeadResult], set[str]]:
    """Every process's results merged, and their paths; refuses differing baselines and missing ablations."""
    gathered = gather((result.baseline_loss, result.baseline_parts, result.path,
                        [entry.to_dict() for entry in result.results]))
    baselines = {(baseline, json.dumps(parts, sort_keys=True)) for baseline, parts, _, _ in gathered}
    if len(baselines) > 1:
        raise ProbeError("the processes computed different baselines (" + ", ".join(
            f"{b!r}" for b, _ in sorted(baselines)) + "): the model is not deterministic across devices, so "
            "their numbers cannot be merged; run the sweep in one process")
    merged = {entry.heads: entry for entry in _merged(entries for _, _, _, entries in gathered)}
    missing = [ablation for ablation in ablations if ablation not in merged]
    if missing:
        raise ProbeError(f"the processes finished without {len(missing)} ablation(s), e.g. {missing[0]}: "
                         "run the sweep again with resume", parameter="resume")
    return merged, {path for _, _, path, _ in gathered}


def sharded_sweep(loaded: LoadedModel, probe_set: ProbeSet, heads: Sequence[Head] | None = None, *,
                  results_path: str | Path, resume: bool = False, groups: Sequence[Sequence[Head]] = (),
                  mode: str = "exact", **options: Any) -> AblationResult | None:
    """This process's share of `sweep` under torchrun; rank 0 returns the merged result (bit for bit `sweep`'s)."""
    results_path = Path(results_path)
    rank = current()
    if rank is None:
        return _alone(loaded, probe_set, heads, results_path, resume, groups=groups, mode=mode, **options)
    if mode == "estimate":
        raise ProbeError("mode 'estimate' is a few forward and backward passes, not a sweep to split: run it "
                         "without torchrun", parameter="mode")
    ablations = ablation_list(loaded.model, heads, groups)
    if not rank.is_main:
        options["progress"] = None
    mine = shard_path(results_path, rank.rank)
    with process_group(input_device(loaded.model)):
        import torch.distributed as dist

        if resume:
            _share_finished(results_path, mine)
        elif rank.is_main:  # shards of an earlier, larger job would be merged into a later resumed run
            for stale in shard_paths(results_path):
                if int(stale.name.rpartition(".shard-")[2]) >= rank.world_size:
                    stale.unlink(missing_ok=True)
        result = sweep(loaded, probe_set, heads, groups=groups, mode=mode, results_path=mine, resume=resume,
                       shard=(rank.rank, rank.world_size), **options)
        merged, paths = _gathered(result, ablations)
        final = None
        if rank.is_main:
            ordered = [merged[ablation] for ablation in ablations]
            write_stream(results_path, read_results(mine)[0], ordered)
            final = dataclasses.replace(result, results=ordered,
                                        path=result.path if len(paths) == 1 else "; ".join(sorted(paths)))
        dist.barrier()  # the merged file is written: every shard is redundant now
        mine.unlink(missing_ok=True)
    return final
