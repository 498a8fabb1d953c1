"""Head classes: `scores` (each class's score, from the literature, in the registry SCORES), `accumulate` (reducing
blocks of attention into those scores), `classify` (scoring every head on its class's probe set, and labelling)."""
