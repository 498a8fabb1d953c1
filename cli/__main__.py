"""`python -m cli` (and `torchrun -m cli`): the `probe` command."""

from cli.app import main

main()
