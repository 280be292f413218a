"""The data-flow graph one probe forward leaves behind: plain records, no behaviour.

Nodes are leaf-module calls (Linear, norms, activations, dropout, ...) and tensor ops run outside leaves.
Container-module calls are kept separately as *scopes*: which tensors entered and left them, so a rewrite can
act at a module boundary (a forward pre-hook) without touching modeling code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..enums import StrChoice


@dataclass
class TensorInfo:
    tid: int
    shape: tuple[int, ...]
    dtype: str
    producer: int | None  # node index, or None for graph inputs / parameters / constants
    param: str | None = None  # qualified name of the model parameter this tensor is (None: not a parameter)


class Callee(StrChoice):
    MODULE = "module"  # a leaf module call
    OP = "op"  # a tensor op run outside leaves


@dataclass
class Node:
    idx: int
    callee: Callee  # what was called: a leaf module or a tensor op
    target: str  # module name for "module", op name for "op" (e.g. "Tensor.view", "torch.nn.functional.pad")
    inputs: list[int]  # tensor ids in argument order (flattened)
    outputs: list[int]
    scopes: tuple[int, ...]  # enclosing container calls, outermost first
    info: dict[str, Any] = field(default_factory=dict)  # op arguments that matter (dims, p, pad, index, ...)


@dataclass
class ArgSlot:
    """Where a tensor entered a module call: positional index or keyword name."""

    position: int | None
    keyword: str | None

    def describe(self) -> str:
        return f"arg {self.position}" if self.keyword is None else f"kwarg {self.keyword!r}"


@dataclass
class ScopeCall:
    idx: int
    module: str  # qualified module name ("" for the root)
    args: dict[int, list[ArgSlot]]  # tensor id -> slots it was passed in
    outputs: list[int]
    parent: int | None
    call_number: int  # how many times this module had been called before in the forward


@dataclass
class Graph:
    tensors: dict[int, TensorInfo] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    scopes: list[ScopeCall] = field(default_factory=list)
    module_calls: dict[str, int] = field(default_factory=dict)  # module name -> number of calls
    root_outputs: dict[int, list[tuple]] = field(default_factory=dict)  # tensor id -> paths in the output
    #: tensor id -> qualified name of the parameter or buffer it is (first name of a tied one), for tensors the
    #: forward used directly (a weight passed to F.linear, bias pieces concatenated in forward); ``TensorInfo.param``
    #: holds the same name for parameters only
    params: dict[int, str] = field(default_factory=dict)
    _consumers: dict[int, list[Node]] | None = field(default=None, repr=False)

    def consumers(self, tid: int) -> list[Node]:
        if self._consumers is None:
            self.build_index()
        return self._consumers.get(tid, [])

    def module_nodes(self, name: str) -> list[Node]:
        return [n for n in self.nodes if n.callee is Callee.MODULE and n.target == name]

    def build_index(self) -> None:
        """Consumer lists by tensor id (graphs of large models have tens of thousands of nodes)."""
        idx: dict[int, list[Node]] = {}
        for n in self.nodes:
            for t in dict.fromkeys(n.inputs):
                idx.setdefault(t, []).append(n)
        self._consumers = idx
