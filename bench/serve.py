"""`probe serve` under load, and its speed on SmolLM2.

    python -m bench.serve load [--model SPEC] [--clients 8] [--requests 25] [--rounds 3]
    python -m bench.serve speed [--tokens 256] [--repeats 3] [--dtype float32|bfloat16]

`load`: a real server on 127.0.0.1 (a free port), `--clients` threads each sending `--requests` mixed requests
(text, head, qk, dla, ablate, generate) over HTTP, per round; each request bounded at 120 s, each round at 10 min.
Reported: failed requests (any answer but 200), whether the model is bit-identical afterwards (`fingerprint`), peak
RSS after each round, p50/p95 latency. The default model is the tests' tiny Llama with words
(tests/words.py:tiny_with_words).

`speed`: SmolLM2 on the CPU and a 256-token text of the embedded English: the first view (one forward capturing
every head's attention, scores, losses and top tokens) against a plain forward, interleaved; a head click on the
seen text in server time (no forward); and each action's answer counted in forwards.

Writes bench/results/serve-load.json, or serve-speed.json (one entry per dtype, the latest run of each).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import resource
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import torch

from bench.common import interleaved, load_average, load_result, machine, now, save_result
from probe.models import load_model
from probe.threads import use_threads

TEXT = "the keys to the cabinet are here , the keys to the cabinet is here , the author near the guards is tired"
ROUND_LIMIT = 600.0


def fingerprint(model: torch.nn.Module) -> str:
    """Every parameter and buffer, bit for bit, and every hook and attention setting of every module."""
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    for name, module in model.named_modules():
        hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
        digest.update(f"{name}{[list(h) for h in hooks]}{type(module).forward}{vars(module).get('forward')}".encode())
    digest.update(str(getattr(getattr(model, "config", None), "_attn_implementation", None)).encode())
    digest.update(str(torch.nn.modules.module._global_forward_pre_hooks).encode())
    return digest.hexdigest()


def _requests(n_layers: int, n_heads: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """A client's mixed requests: mostly clicks on the texts' heads, some actions."""
    chance = random.Random(seed)
    texts = [TEXT, TEXT + " again", "the author near the guards"]
    out = []
    for _ in range(200):
        text, layer, head = chance.choice(texts), chance.randrange(n_layers), chance.randrange(n_heads)
        out += [("text", {"text": text}), ("head", {"text": text, "layer": layer, "head": head}),
                ("qk", {"text": text, "layer": layer, "head": head, "query": 3, "key": 1}),
                ("dla", {"text": text, "position": 2, "token": 5}),
                ("ablate", {"text": text, "heads": [[layer, head]], "method": chance.choice(["zero", "mean", "scale"]),
                            "factor": 2.0, "position": 2}),
                ("generate", {"text": text, "heads": [[layer, head]], "factor": 2.0, "max_new_tokens": 3})]
    chance.shuffle(out)
    return out


def _client(url: str, token: str, requests: list[tuple[str, dict[str, Any]]], latencies: list[float],
            failures: list[str]) -> None:
    for path, body in requests:
        request = urllib.request.Request(f"{url}api/{path}", data=json.dumps(body).encode(), headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                answer.read()
        except (urllib.error.URLError, OSError) as error:
            failures.append(f"{path}: {error}")
        latencies.append(time.perf_counter() - started)


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load(spec: str, clients: int, requests: int, rounds: int) -> dict[str, Any]:
    from probe.serve import start

    loaded = load_model(spec)
    before = fingerprint(loaded.model)
    server = start(loaded)
    url, token = server.url.split("?token=")
    layers = server.handle.config.app.state.views.layers
    results = []
    for round_index in range(rounds):
        latencies: list[float] = []
        failures: list[str] = []
        threads = [threading.Thread(target=_client, args=(url, token, _requests(len(layers), layers[0].n_heads,
                                                                                 round_index * clients + i)[:requests],
                                                          latencies, failures)) for i in range(clients)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(1.0, ROUND_LIMIT - (time.perf_counter() - started)))
        ordered = sorted(latencies)
        results.append({"requests": len(latencies), "failed": len(failures), "failures": failures[:5],
                        "seconds": round(time.perf_counter() - started, 2), "peak_rss_gib": round(_rss() / 2**30, 3),
                        "p50_s": round(statistics.median(ordered), 4),
                        "p95_s": round(ordered[int(0.95 * (len(ordered) - 1))], 4),
                        "unfinished_clients": sum(thread.is_alive() for thread in threads)})
        print(json.dumps(results[-1]), flush=True)
    server.stop()
    return {"model": spec, "clients": clients, "requests_per_client": requests, "rounds": results,
            "identical_after": fingerprint(loaded.model) == before}


def speed(tokens: int, repeats: int, dtype: str) -> dict[str, Any]:
    from probe.hooks.run import run_model
    from probe.inputs import ProbeOptions, build_probe_set
    from probe.serve.views import Views

    loaded = load_model("smollm2", dtype=dtype)
    ids = build_probe_set("natural", loaded, ProbeOptions(num_seqs=1, seq_len=tokens)).input_ids[0, 1:]
    text = str(loaded.tokenizer.decode(ids.tolist()))
    views = Views(loaded)

    def first_view() -> None:
        views.cache.clear()
        views.text(text)

    def plain() -> None:
        with torch.no_grad():
            run_model(loaded.model, torch.tensor([views.view(text)[0].ids.tolist()]))

    timed = interleaved({"plain forward": plain, "first view": first_view}, "plain forward", repeats)
    views.text(text)
    count, started = views.forwards, time.perf_counter()
    views.head(text, (5, 3))
    click = time.perf_counter() - started
    answers = {}
    for method in ("zero", "mean", "mean", "scale"):
        before = views.forwards
        started = time.perf_counter()
        views.ablate(text, [(5, 3)], method, 2.0, 10)
        answers.setdefault(method, []).append({"forwards": views.forwards - before,
                                               "seconds": round(time.perf_counter() - started, 3)})
    return {"dtype": dtype, "tokens": len(views.view(text)[0].tokens), "timing": timed.to_dict(),
            "first_view_over_plain": round(timed.ratio("first view"), 3), "head_click_seconds": round(click, 4),
            "head_click_forwards": views.forwards - count - sum(a["forwards"] for v in answers.values() for a in v),
            "ablation": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["load", "speed"])
    parser.add_argument("--model", default="tests/words.py:tiny_with_words")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    load_before = load_average()
    use_threads(1)
    data = load(args.model, args.clients, args.requests, args.rounds) if args.what == "load" else \
        speed(args.tokens, args.repeats, args.dtype)
    data.update(machine=machine(()), load_before=load_before, load_after=load_average(), date=now(),
                command="python -m bench.serve " + " ".join(sys.argv[1:]))
    print(json.dumps(data, indent=1))
    if args.what == "speed":  # one entry per dtype: a run replaces its own dtype's
        kept = load_result("serve-speed") or {}
        data = {"runs": {**{run["dtype"]: run for run in kept.get("runs", {}).values()}, args.dtype: data}}
    save_result(f"serve-{args.what}", data)


if __name__ == "__main__":
    main()
