"""`python -m bench [NAME ...] [options]`: run the benchmarks (default: all) and rewrite bench/RESULTS.md.

NAME is classification, ablation, taylor, memory, profile or long_context (the default: all of them), or gpu
(bench/gpu.py: on a CUDA device, about 8 minutes on one H100; without one, a tiny dry run on the CPU saved
as bench/results/gpu-dry.json and left out of RESULTS.md). Each benchmark saves bench/results/NAME.json with the
machine, date and this command line; RESULTS.md is rendered from every saved result (`python -m bench --render`
only renders).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable

from bench import report
from bench.common import save_result

ALL = ["classification", "ablation", "taylor", "memory", "profile", "long_context"]
ON_REQUEST = ["gpu", "kernel_compile"]  # run only when named


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", default=[], metavar="NAME",
                        help=f"benchmarks to run ({', '.join(ALL)}); default all")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 7 for classification, "
                                                                   "2 for ablation)")
    parser.add_argument("--ablation-layers", default="all",
                        help="layers whose heads the timed sweep covers, e.g. 2,7,12,17,22,27 (a representative "
                             "sixth, 5x quicker); default all: the full sweep of 270 heads")
    parser.add_argument("--no-estimate", action="store_true", help="skip the exact-vs-estimate comparison")
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192", help="memory benchmark lengths")
    parser.add_argument("--memory-tools", default=None, help="comma list of load_only,probe,hf,tl,tl_patterns")
    parser.add_argument("--profile-length", type=int, default=2048, help="tokens of the long profiled sequence")
    parser.add_argument("--long-lengths", default="128,4096,8192",
                        help="long_context: lengths timed against a plain forward ('' for none)")
    parser.add_argument("--long-repeats", type=int, default=None, help="long_context: repeats per length "
                                                                       "(default 7 at 128, 3 at 4096, 1 at 8192)")
    parser.add_argument("--no-long-memory", action="store_true", help="long_context: skip the 32k memory points")
    parser.add_argument("--no-before", action="store_true", help="long_context: time only plain and probe")
    parser.add_argument("--no-layer-profile", action="store_true", help="long_context: skip the one-layer profile")
    parser.add_argument("--device", default=None, help="classification benchmark: torch device (default cpu)")
    parser.add_argument("--dtype", default="float32", help="classification benchmark: float32, bfloat16, float16")
    parser.add_argument("--no-tl", action="store_true", help="leave TransformerLens out")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice, one per core); 1 keeps ratios steadier "
                             "when other processes load the machine")
    parser.add_argument("--dry-run", action="store_true", help="gpu: the tiny CPU run even where a GPU is present")
    parser.add_argument("--budget", type=float, default=None,
                        help="gpu: seconds for all points (default bench.gpu.BUDGET_SECONDS, 420); points not "
                             "started by then are skipped, in the order bench/gpu.py states")
    parser.add_argument("--render", action="store_true", help="only rewrite RESULTS.md from saved results")
    args = parser.parse_args()
    if args.threads is not None:
        from probe.threads import use_threads

        use_threads(args.threads)
    command = "python -m bench" + ("" if len(sys.argv) == 1 else " " + shlex.join(sys.argv[1:]))
    names = args.names or ([] if args.render else ALL)
    unknown = [name for name in names if name not in ALL + ON_REQUEST]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}: choose from {', '.join(ALL + ON_REQUEST)}")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    for name in names:
        started = time.perf_counter()
        log(f"== {name}")
        if name == "gpu":
            _gpu(args.dry_run, command, log, args.budget)
            continue
        if name == "kernel_compile":  # no GPU: Triton's compiler, every autotune configuration for sm_90 and sm_80
            from bench import kernel_compile

            data = kernel_compile.run(log)
        elif name == "classification":
            from bench import classification

            data = classification.run(repeats=args.repeats or 7, log=log, with_tl=not args.no_tl,
                                      device=args.device, dtype=args.dtype)
        elif name == "ablation":
            from bench import ablation

            layers = None if args.ablation_layers == "all" else [int(x) for x in args.ablation_layers.split(",")]
            data = ablation.run(repeats=args.repeats or 2, layers=layers, log=log, with_tl=not args.no_tl,
                                with_estimate=not args.no_estimate)
        elif name == "taylor":
            from bench import taylor

            data = taylor.run(log=log)
        elif name == "memory":
            from bench import memory

            tools = args.memory_tools.split(",") if args.memory_tools else None
            data = memory.run([int(x) for x in args.lengths.split(",")], tools, log=log)
        elif name == "long_context":
            from bench import long_context

            lengths = [int(x) for x in args.long_lengths.split(",") if x]
            data = long_context.run(lengths, {n: args.long_repeats for n in lengths} if args.long_repeats else None,
                                    memory=not args.no_long_memory, profile_layer=not args.no_layer_profile,
                                    with_before=not args.no_before,
                                    log=log)
        else:
            from bench import profile

            data = profile.run(args.profile_length, log=log)
        data["command"] = command
        data["bench_seconds"] = time.perf_counter() - started
        if name == "memory" and args.memory_tools:  # a subset of tools: keep the other tools' points
            from bench.common import load_result

            previous = load_result("memory")
            if previous is not None:
                runs = previous.get("tool_runs") or {tool: {"date": previous["date"], "command": previous["command"]}
                                                     for tool in previous["points"]}
                runs.update({tool: {"date": data["date"], "command": command} for tool in data["points"]})
                previous["points"].update(data["points"])
                previous["tool_runs"] = runs
                data = previous
        if name == "long_context":  # a run of some lengths (or memory only) keeps the other parts
            from bench.common import load_result

            previous = load_result("long_context") or {}
            data["speed"] = {**previous.get("speed", {}), **data["speed"]}
            data.update({key: value for key, value in previous.items() if key not in data})
        path = save_result(name if not (name == "classification" and args.device not in (None, "cpu"))
                           else f"{name}-{args.device}-{args.dtype}", data)
        log(f"   saved {path} ({data['bench_seconds']:.0f} s)")
    report.write()
    log(f"wrote {report.RESULTS_MD}")


def _gpu(dry_run: bool, command: str, log: Callable[[str], None], budget: float | None = None) -> None:
    """bench/gpu.py: the GPU run saved as gpu.json (rendered into RESULTS.md), a dry run as gpu-dry.json (printed)."""
    import torch

    from bench import gpu, gpu_report

    dry = dry_run or not torch.cuda.is_available()
    started = time.perf_counter()
    data = gpu.run(dry, log, name="gpu-dry" if dry else "gpu", budget=budget)
    data["command"] = command
    data["bench_seconds"] = time.perf_counter() - started
    path = save_result("gpu-dry" if dry else "gpu", data)
    log(f"   saved {path} ({data['bench_seconds']:.0f} s)")
    if dry:
        log(gpu_report.section(data))


if __name__ == "__main__":
    main()
