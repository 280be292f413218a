"""Experiments whose results the docs cite (not benchmarks: they measure what training learns, not time or
bytes). Run from the checkout root, e.g. ``python -m experiments.fidelity`` (writes docs/fidelity.md)."""
