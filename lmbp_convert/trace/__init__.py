"""See: one probe forward → a graph of producers and consumers."""
from .graph import ArgSlot, Graph, Node, ScopeCall, TensorInfo
from .tracer import TraceError, call_model, trace

__all__ = ["ArgSlot", "Graph", "Node", "ScopeCall", "TensorInfo", "TraceError", "call_model", "trace"]
