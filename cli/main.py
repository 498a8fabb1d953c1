"""The entry point under its old name: console scripts installed before `probe` pointed at cli.app:main import it."""

from cli.app import main

__all__ = ["main"]
