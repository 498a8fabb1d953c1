"""Which kinds of evidence support a head's class label: its pattern, its weights, and what it causes.

The atlas (probe.atlas) asks each class's rule here whether three kinds agree: the pattern (the class score passes
its threshold), the weights with no data (Elhage et al. 2021: the copying score of W_E W_OV W_U and K-composition,
probe.circuits.composition), and the cause (the loss change when the head is zero-ablated, probe.ablation, on natural
text and, for some classes, on the part of a probe set where the class's job pays off). A label is *confirmed* when
every kind its rule defines supports it, *pattern only* when none but the pattern does. A new class's rule is one
`register_rule(Rule(...))`; classes without a rule are judged on the cause alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CAUSE_DELTA = 0.01  # nats: a head is needed on natural text when its ablation raises the mean loss by more
PART_DELTA = 0.1  # nats: ... or raises the loss on the part where its class's job pays off by more
COMPOSITION_RATIO = 2.0  # K-composition counts when it is this many times the random baseline
TOP_PARTNERS = 3  # earlier heads (per kind) and later heads kept as a head's composition partners


@dataclass
class Partner:
    """Another head and its composition score with this one (kind: k, q or v)."""

    layer: int
    head: int
    kind: str
    score: float

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "head": self.head, "kind": self.kind, "score": round(self.score, 6)}


@dataclass
class HeadFacts:
    """What the atlas measured of one head, in plain numbers (None: not measured)."""

    layer: int
    head: int
    labels: set[str]  # classes whose pattern score passed (classify)
    delta: float | None = None  # mean loss change on natural text when ablated
    parts: dict[str, float] = field(default_factory=dict)  # probe-set part -> loss change (e.g. second_repeat)
    copying: float | None = None
    feeders: list[Partner] = field(default_factory=list)  # earlier heads composing into this one, strongest first
    readers: list[Partner] = field(default_factory=list)  # later heads this one composes into
    baseline: float | None = None  # composition of random matrices of the same shapes
    flagged: dict[str, set[tuple[int, int]]] = field(default_factory=dict)  # every class's labelled heads
    estimated: bool = False  # `delta` is an estimate (attribution patching), not an ablation


Verdict = tuple[bool, str]
"""(supported, why in a few words)."""
Check = Callable[[HeadFacts], "Verdict | None"]
"""One kind of evidence for one class: None where it was not measured."""


def _strong_k(facts: HeadFacts, partners: list[Partner], heads: set[tuple[int, int]]) -> Partner | None:
    """The first of `partners` among `heads` whose K-composition is more than COMPOSITION_RATIO times the baseline."""
    return next((p for p in partners if p.kind == "k" and (p.layer, p.head) in heads and facts.baseline is not None
                 and p.score > COMPOSITION_RATIO * facts.baseline), None)


def induction_weights(facts: HeadFacts) -> Verdict | None:
    """A previous-token head among its strongest K-composing feeders (above twice the random baseline), and a
    positive copying score: the head's key reads "the token before me", and it copies what it attends to."""
    if facts.copying is None or facts.baseline is None:
        return None
    feeder = _strong_k(facts, facts.feeders, facts.flagged.get("previous_token", set()))
    copies = facts.copying > 0
    if feeder is not None and copies:
        return True, f"K-composition from previous-token head {feeder.layer}.{feeder.head} ({feeder.score:.3f}), " \
                     f"copying {facts.copying:+.2f}"
    missing = [] if feeder is not None else ["no previous-token head among its strongest K feeders"]
    missing += [] if copies else [f"copying {facts.copying:+.2f}"]
    return False, "; ".join(missing)


def previous_token_weights(facts: HeadFacts) -> Verdict | None:
    """It is one of the strongest K-composing feeders of an induction head (above twice the random baseline)."""
    if facts.baseline is None:
        return None
    reader = _strong_k(facts, facts.readers, facts.flagged.get("induction", set()))
    if reader is None:
        return False, "feeds no induction head's keys strongly"
    return True, f"K-composes into induction head {reader.layer}.{reader.head} ({reader.score:.3f})"


def needed(part: str | None = None) -> Check:
    """The cause: the mean loss on natural text rises by more than CAUSE_DELTA when the head is ablated, or the loss
    on `part` (of the probe set the rule names) rises by more than PART_DELTA."""

    def check(facts: HeadFacts) -> Verdict | None:
        if facts.delta is None:
            return None
        if facts.delta > CAUSE_DELTA:
            return True, f"ablation raises the loss by {facts.delta:+.3f}" + (" (estimated)" if facts.estimated else "")
        value = facts.parts.get(part) if part is not None else None
        named = (part or "").replace("_", "-")
        if value is not None and value > PART_DELTA:
            return True, f"ablation raises the {named} loss by {value:+.3f}"
        shown = f"{facts.delta:+.4f}" + (f", {named} {value:+.3f}" if value is not None else "")
        return False, f"ablation changes little ({shown})"

    return check


@dataclass(frozen=True)
class Rule:
    """How one class's label is checked against the weights and the cause; `part` names where on `probe` (a probe
    set) the class's job pays off, measured for the heads with this label."""

    name: str
    weights: Check | None
    cause: Check
    summary: str  # the rule in words, for docs and pages
    probe: str | None = None
    part: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"summary": self.summary, "kinds": ["pattern"] + (["weights"] if self.weights else []) + ["cause"],
                "part": self.part, "probe_set": self.probe}


RULES: dict[str, Rule] = {}
"""Class name -> its evidence rule (`register_rule`); a class without one is judged on the cause alone."""


def register_rule(rule: Rule) -> Rule:
    """Add (or replace) a class's evidence rule: the atlas, its JSON and its page judge that class's labels by it."""
    RULES[rule.name] = rule
    return rule


def rule_for(name: str) -> Rule:
    """The class's rule; a class without one is judged on the cause alone (natural text)."""
    return RULES.get(name) or Rule(name, None, needed(), "pattern, and ablation raises the loss on natural text")


def judge(name: str, facts: HeadFacts) -> dict[str, Any]:
    """One label's evidence: each kind's verdict, which kinds support it, and the sentence the atlas shows."""
    rule = rule_for(name)
    kinds: dict[str, Any] = {"pattern": {"supports": True, "why": "score above the threshold"}}
    for kind, check in (("weights", rule.weights), ("cause", rule.cause)):
        if check is None:
            continue
        verdict = check(facts)
        kinds[kind] = None if verdict is None else {"supports": verdict[0], "why": verdict[1]}
    support = [kind for kind, value in kinds.items() if value is not None and value["supports"]]
    measured = [kind for kind, value in kinds.items() if value is not None]
    if len(measured) == 1:
        status, text = "unchecked", "pattern (nothing else measured)"
    elif len(support) == 1:
        status, text = "pattern_only", "pattern only"
    elif support == measured and len(measured) == len(kinds):
        status, text = "confirmed", "confirmed by " + _words(support)
    else:
        status, text = "partial", "supported by " + _words(support)
    return {"class": name, "kinds": kinds, "supported_by": support, "status": status, "text": text}


def _words(kinds: list[str]) -> str:
    return kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]


for _rule in (
    Rule("induction", induction_weights, needed("second_repeat"),
         "weights: a previous-token head among its strongest K-composing feeders and a positive copying score; "
         "cause: ablation raises the loss on natural text, or on the second copy of a repeated sequence",
         probe="repeated", part="second_repeat"),
    Rule("previous_token", previous_token_weights, needed("second_repeat"),
         "weights: among the strongest K-composing feeders of an induction head; cause: ablation raises the loss on "
         "natural text, or on the second copy of a repeated sequence (it feeds induction)",
         probe="repeated", part="second_repeat"),
):
    register_rule(_rule)
