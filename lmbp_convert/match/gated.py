"""Gated-MLP pattern (act(gate(x)) · up(x) → down), found from data flow. Filled in with the fused op."""
from __future__ import annotations


def find_gated_mlps(planner):
    return []
