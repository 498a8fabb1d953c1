"""The measurements of `python -m bench gpu`, run in a child process (`python -m bench.gpu_points SPEC.json`).

bench/gpu.py starts one child per group of points (a layout: its model is built once) and watches it: the child
writes each event as a JSON line to the spec's rows file as soon as it happens (`start` with the point's deadline,
each `row` as it finishes, `done`), so that nothing finished is lost when a point runs over or the child dies. Inside
a point the deadline is checked between decoder layers and between timed repeats (`Deadline`): a point past it ends
with outcome "timeout" and what it finished so far; one that raises (an out-of-memory error, a refusal) ends with
outcome "error" and the next point runs. A point stuck where no check reaches (one long kernel, a compilation) is the
parent's to stop: it kills the child past the deadline and a grace, and starts a fresh one for the points left.

Candidates are asked, never named: every backend in `probe.kernels.BACKENDS` whose `problem(call)` is "" for the
point's attention call is measured (`using_backend`), against the model's own sdpa forward.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.common import SIX, Timings

LAYOUTS: dict[str, dict[str, Any]] = {  # the layer sizes of the models the plan names (random init)
    "135M": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "intermediate_size": 1536, "vocab_size": 49152},
    "1B": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192, "vocab_size": 128256},
    "8B": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 128256},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 120},
}
LAST_ROWS = 64  # the query rows the float32 reference computes (never n x n): each row sees every key before it
BOUNDS = {"float32": 1e-5, "bfloat16": 1e-4}  # largest difference of the five diagonal and column scores allowed
Emit = Callable[[dict[str, Any]], None]


class PointTimeout(BaseException):
    """A point ran past its deadline (a BaseException: no `except Exception` on the way wraps or swallows it)."""


class Deadline:
    """A point's deadline, checked between decoder layers (forward pre-hooks) and between timed runs."""

    def __init__(self, at: float) -> None:
        self.at, self.fired = at, ""

    def check(self, where: str) -> None:
        if time.time() > self.at:
            self.fired = where
            raise PointTimeout(where)

    @contextmanager
    def on_layers(self, model: torch.nn.Module) -> Iterator[None]:
        """The check before every decoder layer of `model` while the block runs."""
        layers = getattr(getattr(model, "model", model), "layers", [])
        handles = [layer.register_forward_pre_hook(lambda *_, index=index: self.check(f"layer {index}"))
                   for index, layer in enumerate(layers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


class Context:
    """What a child keeps between its points: the device, dtype, the current model, where events go."""

    def __init__(self, device: str, dtype: torch.dtype, emit: Emit) -> None:
        self.device, self.dtype, self.emit = device, dtype, emit
        self.deadline = Deadline(float("inf"))
        self._models: dict[tuple[str, str, int], Any] = {}

    def model(self, layout: str, positions: int, dtype: torch.dtype | None = None) -> Any:
        """The layout's random-init model (one kept at a time), made on the device."""
        key = (layout, str(dtype or self.dtype), positions)
        if key not in self._models:
            self._models.clear()
            self.empty_cache()
            self._models[key] = random_llama(layout, self.device, dtype or self.dtype, positions)
        return self._models[key]

    def finish(self) -> None:
        """Wait for the device: a timed run ends when its kernels do."""
        if self.device == "cuda":
            torch.cuda.synchronize()

    def empty_cache(self) -> None:
        if self.device == "cuda":
            torch.cuda.empty_cache()


def random_llama(layout: str, device: str, dtype: torch.dtype, positions: int) -> Any:
    """A random-init llama with the layout's layer sizes, made on the device in `dtype` (sdpa attention), no tokenizer
    (needle prompts are then token ids: probe.inputs.needle's tokenizer-free prompts)."""
    import transformers

    from probe.models import LoadedModel

    sizes = LAYOUTS[layout]
    config = transformers.LlamaConfig(**sizes, max_position_embeddings=positions,
                                      head_dim=sizes["hidden_size"] // sizes["num_attention_heads"])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return LoadedModel(model=model.eval(), tokenizer=None, name=f"random-{layout}", vocab_size=config.vocab_size)


def repeated_set(vocab: int, length: int) -> Any:
    """One sequence of BOS (id 1) + R random tokens repeated twice, R = (length - 1) // 2 (length even: one more)."""
    from probe.inputs import ProbeSet

    generator = torch.Generator().manual_seed(0)
    half = torch.randint(100 if vocab > 200 else 2, vocab, (1, (length - 1) // 2), generator=generator)
    ids = torch.cat([torch.ones(1, 1, dtype=torch.long), half, half, half[:, :length - 1 - 2 * half.shape[1]]], dim=1)
    return ProbeSet("repeated", "random tokens, repeated", ids, 1, repeat_len=half.shape[1])


def layer_inputs(layout: str, length: int, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Random queries, keys and values of one layer of the layout (grouped heads as the model has them)."""
    sizes = LAYOUTS[layout]
    hq, hk = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    d = sizes["hidden_size"] // hq
    generator = torch.Generator(device).manual_seed(0)
    query, key, value = (torch.randn(1, heads, length, d, generator=generator, device=device, dtype=dtype)
                         for heads in (hq, hk, hk))
    return {"query": query, "key": key, "value": value, "scaling": d ** -0.5}


def candidates(layout: str, length: int, device: str, dtype: torch.dtype) -> tuple[list[Any], dict[str, str]]:
    """(the registered backends that serve the layout's causal call at this length, in registry order; each other's
    reason). The call's tensors have the real shapes, dtype and device, their values unset (a backend's `problem`
    reads none)."""
    from probe.kernels import BACKENDS, AttentionCall

    sizes = LAYOUTS[layout]
    hq, hk = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    d = sizes["hidden_size"] // hq
    query, key = (torch.empty(1, heads, length, d, device=device, dtype=dtype) for heads in (hq, hk))
    call = AttentionCall(query, key, key, None, d ** -0.5, True)
    serving, refused = [], {}
    for backend in list(BACKENDS):
        reason = backend.problem(call)
        if reason:
            refused[backend.name] = reason
        else:
            serving.append(backend)
    return serving, refused


def timed(ctx: Context, variants: dict[str, Callable[[], Any]], baseline: str, repeats: int,
          failed: dict[str, str] | None = None, memory: dict[str, int | None] | None = None) -> Timings:
    """Each variant once to warm up, then `repeats` rounds interleaved (the order rotated each round), the deadline
    checked between runs. Past the deadline the rounds finished so far are kept on the raised PointTimeout. A
    variant other than the baseline that raises in its warm-up is left out, its error in `failed`. `memory`: each
    variant's peak bytes in the last round (torch.cuda.max_memory_allocated, reset before it; None off CUDA)."""
    names = list(variants)
    for name in list(names):
        ctx.deadline.check(f"warm-up of {name}")
        try:
            variants[name]()
            ctx.finish()
        except Exception as error:
            if name == baseline or failed is None:
                raise
            failed[name] = _error_text(error)
            names.remove(name)
            ctx.empty_cache()
    timings = Timings(baseline, {name: [] for name in names})
    for repeat in range(repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        done: dict[str, float] = {}
        last = repeat == repeats - 1 and memory is not None and ctx.device == "cuda"
        try:
            for name in order:
                ctx.deadline.check(f"repeat {repeat + 1} of {name}")
                gc.collect()  # not inside a timed run
                if last:
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                variants[name]()
                ctx.finish()
                done[name] = time.perf_counter() - start
                if memory is not None:
                    memory[name] = int(torch.cuda.max_memory_allocated()) if last else None
        except PointTimeout as error:  # between runs or inside one (between layers)
            error.timings = timings if repeat else None  # type: ignore[attr-defined]
            raise
        for name in names:
            timings.seconds[name].append(done[name])
    return timings


def _largest(first: Any, second: Any) -> float:
    return max(float((first[name].double() - second[name].double()).abs().nan_to_num(nan=float("inf")).max())
               for name in SIX)


def classify_point(ctx: Context, point: dict[str, Any]) -> None:
    """classify's scoring pass (six default scores) under each serving backend against the plain sdpa forward
    (`run_model(..., logits=False)`, what classify runs): interleaved timings, peak memory, the path the scores took,
    their largest difference to the first backend's; then one layer's attention per backend (`kernel_rows`)."""
    from probe.heads.classify import score_heads
    from probe.hooks.run import run_model
    from probe.kernels import using_backend

    layout, length = point["layout"], point["tokens"]
    loaded = ctx.model(layout, point["positions"])
    probe_set = repeated_set(loaded.vocab_size, length)
    ids = probe_set.input_ids.to(ctx.device)
    serving, refused = candidates(layout, length, ctx.device, ctx.dtype)
    base = {"kind": "classify", "layout": layout, "tokens": length, "refused": refused}
    if not serving:
        ctx.emit({**base, "outcome": "error", "error": f"no registered backend serves this call: {refused}"})
        return
    found: dict[str, Any] = {}

    def plain() -> None:
        with torch.no_grad():
            run_model(loaded.model, ids, None, logits=False)

    def scoring(backend: Any) -> Callable[[], None]:
        def run() -> None:
            with using_backend(backend):
                found[backend.name] = score_heads(loaded, probe_set, SIX, batch_size=1)
        return run

    variants = {"plain": plain, **{backend.name: scoring(backend) for backend in serving}}
    memory: dict[str, int | None] = {}
    with ctx.deadline.on_layers(loaded.model):
        timings = _timed_rows(ctx, variants, point["repeats"], base, memory)
    serving = [backend for backend in serving if backend.name in timings.seconds]
    first = found[serving[0].name] if serving else None
    for backend in serving:
        scores = found[backend.name]
        ctx.emit({**base, "backend": backend.name, "outcome": "ok", "ratio": timings.ratio(backend.name),
                  "seconds": {"plain": timings.median("plain"), "probe": timings.median(backend.name)},
                  "repeats": len(timings.seconds["plain"]), "peak_bytes": {"plain": memory["plain"],
                                                                           "probe": memory[backend.name]},
                  "path": scores.path, "served": scores.path == backend.name,
                  "difference_to_first": {"backend": serving[0].name, "largest": _largest(scores, first)}})
    kernel_rows(ctx, layout, length, serving)


def _timed_rows(ctx: Context, variants: dict[str, Callable[[], Any]], repeats: int, base: dict[str, Any],
                memory: dict[str, int | None]) -> Timings:
    """`timed`; a backend that raised in its warm-up as an error row (the others go on); where the deadline cut the
    rounds, those finished as rows before the timeout."""
    failed: dict[str, str] = {}
    try:
        timings = timed(ctx, variants, "plain", repeats, failed, memory)
    except PointTimeout as error:
        _failed_rows(ctx, failed, base)
        partial = getattr(error, "timings", None)
        if partial is not None:
            for name in [name for name in list(variants)[1:] if name not in failed]:
                ctx.emit({**base, "backend": name, "outcome": "timeout", "where": str(error),
                          "ratio": partial.ratio(name), "repeats": len(partial.seconds[name]),
                          "seconds": {"plain": partial.median("plain"), "probe": partial.median(name)}})
        raise
    _failed_rows(ctx, failed, base)
    return timings


def _failed_rows(ctx: Context, failed: dict[str, str], base: dict[str, Any]) -> None:
    for name, text in failed.items():
        ctx.emit({**base, "backend": name, "outcome": "error", "error": text})


def last_rows_reference(inputs: dict[str, Any], count: int) -> dict[str, torch.Tensor]:
    """Causal attention of the last `count` query rows in float32, written out (never n x n: count x n per head):
    output (b, hq, count, dv), log-sum-exp and logits (b, hq, count, n)."""
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    b, hq, n, d = query.shape
    hk = key.shape[1]
    count = min(count, n)
    rows = query[:, :, n - count:].float().reshape(b, hk, (hq // hk) * count, d)  # head h reads kv head h // rep
    logits = (rows @ key.float().transpose(-1, -2) * inputs["scaling"]).view(b, hq, count, n)
    positions = torch.arange(n - count, n, device=query.device)
    hidden = torch.arange(n, device=query.device)[None, :] > positions[:, None]
    logits = logits.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - lse[..., None]).view(b, hk, (hq // hk) * count, n)
    output = (weights @ value.float()).view(b, hq, count, -1)
    return {"output": output, "lse": lse, "logits": logits}


def _errors(reference: dict[str, torch.Tensor], output: torch.Tensor, statistics: Any = None) -> dict[str, float]:
    """Largest differences of the last rows to the reference: output (b, count, hq, dv as a backend returns it),
    log-sum-exp, and how far each row's top key's logit lies under the row's largest (0: the top key is right)."""
    count = reference["output"].shape[2]
    found = {"output": float((output[:, -count:].transpose(1, 2).float() - reference["output"]).abs().max())}
    if statistics is not None:
        n = reference["logits"].shape[-1]
        rows = torch.arange(n - count, n, device=output.device)
        found["lse"] = float((statistics.lse[:, :, -count:].float() - reference["lse"]).abs().max())
        from probe.kernels import Weights

        tops = Weights(statistics).row_tops(rows).to(reference["logits"].device)
        chosen = reference["logits"].gather(-1, tops[..., None]).squeeze(-1)
        found["top_key_gap"] = float((reference["logits"].amax(dim=-1) - chosen).max())
    return found


def kernel_rows(ctx: Context, layout: str, length: int, serving: list[Any]) -> None:
    """One layer's causal attention: each backend's `run` against torch's sdpa (timed), both against the float32
    reference of the last rows."""
    from probe.kernels import DEFAULT_CONFIG, AttentionCall

    inputs = layer_inputs(layout, length, ctx.device, ctx.dtype)
    query, key, value, scaling = inputs["query"], inputs["key"], inputs["value"], inputs["scaling"]
    call = AttentionCall(query, key, value, None, scaling, True)
    reference = last_rows_reference(inputs, LAST_ROWS)
    repeat = query.shape[1] // key.shape[1]  # sdpa's fused kernels get every head's keys (grouped heads repeated
    keys, values = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)  # once, outside the timing)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling)

    sdpa_error = _errors(reference, sdpa().transpose(1, 2))["output"]
    for backend in serving:
        def fused(backend: Any = backend) -> Any:
            return backend.run(call, DEFAULT_CONFIG)

        failed: dict[str, str] = {}
        timings = timed(ctx, {"sdpa": sdpa, backend.name: fused}, "sdpa", 5 if ctx.device == "cuda" else 1, failed)
        if failed:
            ctx.emit({"kind": "kernel", "layout": layout, "tokens": length, "backend": backend.name,
                      "outcome": "error", "error": failed[backend.name]})
            continue
        output, statistics = backend.run(call, DEFAULT_CONFIG)
        ctx.emit({"kind": "kernel", "layout": layout, "tokens": length, "backend": backend.name, "outcome": "ok",
                  "ratio": timings.ratio(backend.name), "reference_rows": reference["output"].shape[2],
                  "seconds": {"sdpa": timings.median("sdpa"), "backend": timings.median(backend.name)},
                  "largest_error": _errors(reference, output, statistics), "sdpa_error": sdpa_error})
        del output, statistics


def kv_point(ctx: Context, point: dict[str, Any]) -> None:
    """kv-heads' scoring pass (`score_needles`, one needle prompt of token ids: the model has no tokenizer) under
    each serving backend against the plain forward kv-heads runs (logits everywhere)."""
    from probe.hooks.run import run_model
    from probe.inputs import NeedleOptions, needle_set
    from probe.kernels import using_backend
    from probe.kv import KV_SINK, score_needles

    layout, length = point["layout"], point["tokens"]
    loaded = ctx.model(layout, point["positions"])
    needles = needle_set(loaded, NeedleOptions(lengths=(length,), depths=(0.5,), seed=7))
    ids = needles.input_ids.to(ctx.device)
    serving, refused = candidates(layout, int(ids.shape[1]), ctx.device, ctx.dtype)

    def plain() -> None:
        with torch.no_grad():
            run_model(loaded.model, ids, None)

    def scoring(backend: Any) -> Callable[[], None]:
        def run() -> None:
            with using_backend(backend):
                score_needles(loaded, needles, sink=KV_SINK)
        return run

    variants = {"plain": plain, **{backend.name: scoring(backend) for backend in serving}}
    base = {"kind": "kv", "layout": layout, "tokens": int(ids.shape[1]), "refused": refused}
    if not serving:
        ctx.emit({**base, "outcome": "error", "error": f"no registered backend serves this call: {refused}"})
        return
    memory: dict[str, int | None] = {}
    with ctx.deadline.on_layers(loaded.model):
        timings = _timed_rows(ctx, variants, point["repeats"], base, memory)
    for backend in [backend for backend in serving if backend.name in timings.seconds]:
        ctx.emit({**base, "backend": backend.name, "outcome": "ok", "ratio": timings.ratio(backend.name),
                  "seconds": {"plain": timings.median("plain"), "probe": timings.median(backend.name)},
                  "repeats": len(timings.seconds["plain"]),
                  "peak_bytes": {"plain": memory["plain"], "probe": memory[backend.name]}})


def agreement_point(ctx: Context, point: dict[str, Any]) -> None:
    """The six scores with each serving backend forced (path "lse") against the blocked path, float32 and bfloat16,
    at a length the blocked path handles quickly; the path each took."""
    from probe.heads.classify import score_heads
    from probe.kernels import using_backend

    layout, length = point["layout"], point["tokens"]
    for dtype in (torch.float32, torch.bfloat16):
        loaded = ctx.model(layout, point["positions"], dtype)
        probe_set = repeated_set(loaded.vocab_size, length)
        serving, _ = candidates(layout, length, ctx.device, dtype)
        with ctx.deadline.on_layers(loaded.model):
            blocked = score_heads(loaded, probe_set, SIX, batch_size=1, path="blocked")
            for backend in serving:
                with using_backend(backend):
                    fast = score_heads(loaded, probe_set, SIX, batch_size=1, path="lse")
                differences = {name: float((fast[name] - blocked[name]).abs().max()) for name in SIX}
                name = str(dtype).removeprefix("torch.")
                worst = max(value for key, value in differences.items() if key != "positional")
                ctx.emit({"kind": "agreement", "layout": layout, "tokens": length, "backend": backend.name,
                          "dtype": name, "outcome": "ok", "path": fast.path, "largest_difference": differences,
                          "bound": BOUNDS[name], "agrees": fast.path == backend.name and worst <= BOUNDS[name]})


def sync_point(ctx: Context, point: dict[str, Any]) -> None:
    """Whether classify's and kv-heads' scoring passes wait for the GPU inside a forward (bench/gpu_sync.py)."""
    from bench.gpu_sync import kv_sync_check, sync_check

    loaded = ctx.model(point["layout"], point["positions"])
    probe_set = repeated_set(loaded.vocab_size, point["tokens"])
    checks = {"classify": lambda: sync_check(loaded, probe_set, SIX, ctx.device),
              "kv-heads": lambda: kv_sync_check(loaded, point["tokens"], ctx.device)}
    for what, check in checks.items():
        with ctx.deadline.on_layers(loaded.model):
            found = check()
        ctx.emit({"kind": "sync", "layout": point["layout"], "tokens": point["tokens"], "pass": what,
                  "outcome": "ok", **found})


KINDS: dict[str, Callable[[Context, dict[str, Any]], None]] = {
    "classify": classify_point, "kv": kv_point, "agreement": agreement_point, "sync": sync_point}


def _outcome(ctx: Context, point: dict[str, Any], error: BaseException) -> dict[str, Any]:
    """A point that did not finish, as its row: past its deadline, or the error it raised (an OOM included)."""
    row = {"kind": point["kind"], "layout": point["layout"], "tokens": point["tokens"]}
    if ctx.deadline.fired:
        return {**row, "outcome": "timeout", "where": ctx.deadline.fired}
    return {**row, "outcome": "error", "error": _error_text(error),
            "out_of_memory": isinstance(_root(error), torch.OutOfMemoryError)}


def _root(error: BaseException) -> BaseException:
    """The first cause (probe's wrappers make a RuntimeError a ProbeError)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _error_text(error: BaseException) -> str:
    cause = _root(error)
    return f"{type(cause).__name__}: {cause}".splitlines()[0][:400]


def _healthy(device: str) -> bool:
    """Whether the device still works after an error (an illegal memory access breaks the context for good)."""
    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return True
    except Exception:
        return False


def run_points(spec: dict[str, Any]) -> int:
    """Every point of the spec in order, events appended to its rows file; 3 where the device broke (the parent
    starts a fresh child for the points left)."""
    device = spec["device"]
    with Path(spec["rows"]).open("a", encoding="utf-8") as rows:
        def emit(event: dict[str, Any]) -> None:
            rows.write(json.dumps({"event": "row", "id": current, "row": event}, default=str) + "\n")
            rows.flush()

        ctx = Context(device, getattr(torch, spec["dtype"]), emit)
        for point in spec["points"]:
            current = point["id"]
            ctx.deadline = Deadline(min(time.time() + point["cap"], spec["budget_end"]))
            rows.write(json.dumps({"event": "start", "id": current, "deadline": ctx.deadline.at}) + "\n")
            rows.flush()
            started = time.perf_counter()
            try:
                KINDS[point["kind"]](ctx, point)
            except (Exception, PointTimeout) as error:
                emit({**_outcome(ctx, point, error), "point_seconds": round(time.perf_counter() - started, 2)})
            rows.write(json.dumps({"event": "done", "id": current,
                                   "seconds": round(time.perf_counter() - started, 2)}) + "\n")
            rows.flush()
            if not _healthy(device):
                return 3
    return 0


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    if spec["device"] == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the Triton kernel on CPU tensors (read when triton is imported)
    return run_points(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
