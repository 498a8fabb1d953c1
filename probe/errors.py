"""The one exception probe raises for bad input: the CLI turns it into a single line and a non-zero exit."""


class ProbeError(Exception):
    """Bad input or an unusable model; the message says what is wrong and what to do."""
