"""What every matcher reads: the traced graph, the live modules, their roles and the options — plus the
modules earlier matchers have claimed. Read-only for matchers; the planner updates ``claimed``."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from ..options import ConvertOptions
from ..reasons import Reason
from ..trace.graph import Graph, Node
from .roles import Role

if TYPE_CHECKING:  # the walker imports this module
    from .norm_walk import Walk

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def tensor_bytes(g: Graph, tid: int) -> tuple[int, int]:
    """(elements, bytes) of a traced tensor."""
    info = g.tensors[tid]
    n = math.prod(info.shape)
    return n, n * _ITEMSIZE.get(info.dtype, 4)


def code_bytes(numel: int, bits: int) -> int:
    """Bytes an approximate activation keeps for ``numel`` elements (3 bits use 4-bit slots)."""
    slot = 4 if bits == 3 else bits
    return math.ceil(numel * slot / 8)


def _param_owners(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) → every qualified name it is reachable under (more than one: tied weights)."""
    owners: dict[int, list[str]] = defaultdict(list)
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            owners[id(p)].append(f"{mname}.{pname}" if mname else pname)
    return owners


@dataclass
class MatchContext:
    model: nn.Module
    g: Graph
    roles: dict[str, Role]
    opt: ConvertOptions
    #: norms whose affine the checkpoint CLI already folded on disk (from the model's config)
    prefolded: frozenset[str] = frozenset()
    #: the traced probe input (None where the caller has none): matchers that must run the model again use it
    probe: Any = None
    modules: dict[str, nn.Module] = field(init=False)
    param_owners: dict[int, list[str]] = field(init=False)
    #: modules taken over by an item already planned: later matchers leave them alone
    claimed: set[str] = field(default_factory=set, init=False)
    #: module → whether it passed the projection behaviour check (`projection.is_projection_node`), run once each
    projection_checked: dict[str, bool] = field(default_factory=dict, init=False)
    #: module calls whose module carries a user's hook (`norm._hooked_calls`), found once per graph
    hooked_calls: list | None = field(default=None, init=False)
    #: LoRA Linear → why the norm's β cannot be folded into it (adapter dropout, a trained adapter): a problem of
    #: folds only, so under exact norms (``fold_norms=False``) it refuses only a norm that stays a fold
    beta_fold_problems: dict[str, Reason] = field(default_factory=dict, init=False)
    #: norm → the walk its fold was planned from (`match.norm.plan_norm`): what the door check reads
    walks: dict[str, Walk] = field(default_factory=dict, init=False)
    #: what a matcher found worth a line of the report that is neither an item nor a skip (`Plan.notes`)
    notes: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.modules = dict(self.model.named_modules())
        self.param_owners = _param_owners(self.model)

    def scope_name(self, node: Node) -> str:
        """The innermost module call a graph node runs in."""
        return self.g.scopes[node.scopes[-1]].module or "<model>" if node.scopes else "<model>"
