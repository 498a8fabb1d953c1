"""`python -m probe.cli` (and `torchrun -m probe.cli`): the `probe` command."""

from probe.cli.app import main

main()
