"""One point of the long-context benchmark, in a fresh process: `python -m bench.long_context_point TOOL LENGTH`.

The model is a random llama with SmolLM2-135M's layer sizes (hidden 576, 9 query / 3 key-value heads of 64, MLP
1536, vocabulary 49,152), 2 layers and a context of 32,768 tokens: SmolLM2's own context is 8,192, and memory per
layer is what long context costs. TOOL:
- classify: `probe.classify(...)` of every head, all six scores, one sequence of LENGTH tokens (both probe sets; the
  log-sum-exp path); classify_blocked: the same on the blocked path;
- plain: one sdpa forward of LENGTH random tokens, logits at one position (the forward classify runs);
- heatmap: `attention_patterns` of every head over the last 512 positions of LENGTH tokens (the model runs on all);
- equal: the six scores computed in query blocks (the default) and unblocked (one block: the full heads x n x n
  matrix), printed with their largest difference;
- load_only: build the model and stop (the floor).
Prints one JSON line; the parent reads the peak RSS from the kernel.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

CONTEXT = 32768
WINDOW = 512


def tiny_long_llama() -> Any:
    """A random llama with SmolLM2-135M's layer sizes, 2 layers, 32k context (float32, eval)."""
    import transformers as tf

    from probe.models import LoadedModel

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=CONTEXT,
                            rope_theta=100000.0, tie_word_embeddings=True)
    model = tf.LlamaForCausalLM(config).eval()
    return LoadedModel(model=model, tokenizer=None, name="random-llama-32k", vocab_size=config.vocab_size)


def _equal(loaded: Any, length: int) -> dict[str, Any]:
    from probe.inputs import natural_set, repeated_set
    from probe.heads.classify import score_heads
    from probe.heads.scores import SCORES

    out: dict[str, Any] = {}
    for probe_set in (natural_set(loaded, seq_len=length, num_seqs=1),
                      repeated_set(loaded, repeat_len=(length - 1) // 2, num_seqs=1)):
        names = [name for name, score in SCORES.items() if score.probe == probe_set.name]
        blocked = score_heads(loaded, probe_set, names, batch_size=1)
        whole = score_heads(loaded, probe_set, names, batch_size=1, query_block=probe_set.input_ids.shape[1])
        out.update({name: float((blocked[name] - whole[name]).abs().max()) for name in names})
    return out


def main() -> None:
    tool, length = sys.argv[1], int(sys.argv[2])
    loaded = tiny_long_llama()
    start = time.perf_counter()
    result: dict[str, Any] = {"tool": tool, "length": length}
    if tool in ("classify", "classify_blocked"):
        from probe.heads.classify import classify

        classification = classify(loaded, seq_len=length, num_seqs=1, repeat_len=(length - 1) // 2, batch_size=1,
                                  path="blocked" if tool == "classify_blocked" else "auto")
        result["heads_scored"] = classification.n_layers * classification.n_heads
        result["path"] = classification.path
    elif tool == "plain":
        from probe.hooks.run import run_model

        torch.manual_seed(1)
        with torch.no_grad():
            run_model(loaded.model, torch.randint(1, loaded.vocab_size, (1, length)), None, logits=False)
    elif tool == "heatmap":
        from probe.patterns import attention_patterns

        torch.manual_seed(1)
        ids = torch.randint(1, loaded.vocab_size, (length,))
        patterns = attention_patterns(loaded, ids, source="random tokens", start=length - WINDOW,
                                      max_tokens=WINDOW)
        result["values_shape"] = list(patterns.values.shape)
    elif tool == "equal":
        result["largest_difference"] = _equal(loaded, length)
    elif tool != "load_only":
        raise SystemExit(f"unknown tool {tool!r}")
    result["seconds"] = time.perf_counter() - start
    print(json.dumps(result))


if __name__ == "__main__":
    main()
