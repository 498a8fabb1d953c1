"""One point of benchmark 3, run in a fresh process: `python -m bench.memory_point TOOL LENGTH`.

TOOL is one of:
- load_only: load SmolLM2 and stop (the floor every other point stands on);
- hf: one forward with `output_attentions=True` (eager attention), the attentions of all layers held;
- tl: TransformerLens `run_with_cache` on the same ids (every hook cached, as its docs show);
- tl_patterns: TransformerLens `run_with_cache` filtered to the `hook_pattern` hooks.
LENGTH counts BOS: the ids are BOS + LENGTH - 1 tokens of probe's embedded English text. probe itself is measured
through its command line (`probe classify --seq-len LENGTH-1 --num-seqs 1 --batch-size 1`), by bench.memory.
Prints one JSON line; the parent reads the peak RSS from the kernel.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch


def main() -> None:
    tool, length = sys.argv[1], int(sys.argv[2])
    from probe.inputs import natural_set
    from probe.models import load_model

    loaded = load_model("smollm2")
    ids = natural_set(loaded, seq_len=length - 1, num_seqs=1).input_ids
    after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with torch.no_grad():
        if tool == "hf":
            loaded.model.set_attn_implementation("eager")
            output = loaded.model(input_ids=ids, use_cache=False, output_attentions=True)
            held = sum(a.numel() * a.element_size() for a in output.attentions)
        elif tool in ("tl", "tl_patterns"):
            from transformer_lens.model_bridge import TransformerBridge

            from bench.common import TL_MODEL_ID

            loaded.model.config.architectures = ["LlamaForCausalLM"]  # this process uses the model for TL only
            bridge = TransformerBridge.boot_transformers(TL_MODEL_ID, hf_model=loaded.model,
                                                         tokenizer=loaded.tokenizer, device="cpu")
            if tool == "tl":
                _, cache = bridge.run_with_cache(ids)
            else:
                _, cache = bridge.run_with_cache(ids, names_filter=lambda name: name.endswith("hook_pattern"))
            held = sum(v.numel() * v.element_size() for v in cache.values())
        elif tool == "load_only":
            held = 0
        else:
            raise SystemExit(f"unknown tool {tool!r}")
    seconds = time.perf_counter() - start
    print(json.dumps({"tool": tool, "length": int(ids.shape[1]), "after_load_rss": after_load,
                      "held_bytes": held, "seconds": seconds}))


if __name__ == "__main__":
    main()
