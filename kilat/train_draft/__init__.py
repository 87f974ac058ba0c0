"""``kilat train-draft``: EAGLE-3 heads trained for a target from its own answers, on the CPU."""
