"""probe's benchmarks against a plain forward, a naive loop and TransformerLens: `python -m bench` (see RESULTS.md)."""
