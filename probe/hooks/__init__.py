"""Find a model's attention layers and hook them: one module per job.

- `layers`: discovery (`attention_layers`) and `AttentionLayer`.
- `blocked`: the shared eager computation, query block by query block (`blocked_attention`).
- `hf`, `mha`, `custom`: one module per kind of attention layer, each installing its hooks for one layer.
- `run`: one forward the way probe runs every model, and `logits_of` (probe.models.outputs) reading its logits.
- `capture`: the public context manager `attention_hooks`, and `capture_attention`.
- `points`: the named hook points (`POINTS`) every installer fires; `types`: the one handler signature,
  `fn(payload, ctx)`, and its `HookContext`; `trace`: `Trace`, their public context manager, and its writers.
- `restore`: clean-up that a second Ctrl-C cannot cut short.
- `transformers_api`: every use of transformers' attention machinery, each named; `masks`: the structure of the
  masks transformers makes for probe's implementation.

`probe` re-exports the names most scripts need (`probe.__all__`, made from its imports).
"""
