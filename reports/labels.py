"""How a head is named in every report: one short form (`18.6`, tables, axes, lists) and one long form
(`layer 18, head 6`, hovers, titles and sentences). probe.ablate's labels of heads ablated together (`5.1+18.6`) join
short forms. The page script (assets/probe.js) writes the long form the same way."""

from __future__ import annotations


def short_label(layer: int, head: int) -> str:
    """`18.6`: the form --heads takes."""
    return f"{layer}.{head}"


def long_label(layer: int, head: int) -> str:
    """`layer 18, head 6`: for a reader rather than for a command line."""
    return f"layer {layer}, head {head}"
