"""Find a model's attention layers and hook them, one module per job (docs/architecture.md lists them)."""
