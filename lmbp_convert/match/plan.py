"""A conversion plan: plain, printable, serialisable data shared by ``convert()`` and the checkpoint CLI."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class LinearTarget:
    name: str
    layout: str  # "out_in" (nn.Linear) or "in_out" (HF Conv1D)
    via: list[str] = field(default_factory=list)  # commuting ops between the norm and this Linear
    adds_bias: bool = False  # the Linear has no bias but the norm has β
    base: str | None = None  # LoRA-wrapped Linear: attribute of the base layer (folded like a Linear) ...
    lora_adapters: list[str] = field(default_factory=list)  # ... and adapters whose lora_A gets A·diag(γ)
    lora_a_attr: str | None = None


@dataclass
class ReapplySite:
    """Where the folded-out affine is put back for a consumer that is not a folded Linear."""

    kind: str  # "module_input" (forward pre-hook) or "root_output" (forward hook on the model)
    module: str  # module name ("" for the root)
    position: int | None = None
    keyword: str | None = None
    paths: list[list] = field(default_factory=list)  # for root_output: paths in the output structure
    consumer: str = ""

    def describe(self) -> str:
        if self.kind == "root_output":
            return f"model output {', '.join('.'.join(map(str, p)) for p in self.paths)}"
        slot = f"arg {self.position}" if self.keyword is None else f"{self.keyword}="
        return f"input {slot} of {self.module or '<model>'}"


@dataclass
class NormFold:
    name: str
    cls: str
    kind: str  # "layer" | "rms"
    param: str  # "w" | "1+w"
    eps: float
    shape: list[int]
    has_bias: bool
    targets: list[LinearTarget] = field(default_factory=list)
    reapply: list[ReapplySite] = field(default_factory=list)
    caveats: list[str] = field(default_factory=list)
    predicted_saved_bytes: int = 0
    prefolded: bool = False  # weights already folded on disk (checkpoint CLI): swap only
    # where β goes: "fold" (into the Linears' biases), "shift" (a target has no bias: β stays the norm's own
    # parameter and each target adds W·β after its matmul, so no state-dict key is added), "none" (no β)
    beta: str = "fold"


@dataclass
class ActSwap:
    name: str
    cls: str
    kind: str
    bits: int
    predicted_saved_bytes: int = 0


@dataclass
class GatedMLPSwap:
    name: str
    cls: str
    act: str  # activation kind
    act_module: str
    gate: str | None
    up: str | None
    gate_up: str | None
    down: str
    gate_first: bool = True
    predicted_saved_bytes: int = 0


@dataclass
class Skip:
    name: str
    cls: str
    reason: str


@dataclass
class Plan:
    act_swaps: list[ActSwap] = field(default_factory=list)
    norm_folds: list[NormFold] = field(default_factory=list)
    gated_mlps: list[GatedMLPSwap] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    already_converted: list[str] = field(default_factory=list)
    probe_tokens: int = 0
    probe_unit: str = "token"
    options: dict = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.act_swaps or self.norm_folds or self.gated_mlps)

    @property
    def predicted_saved_bytes(self) -> int:
        return sum(x.predicted_saved_bytes for x in [*self.act_swaps, *self.norm_folds, *self.gated_mlps])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        def norm(d):
            d = dict(d)
            d["targets"] = [LinearTarget(**t) for t in d.get("targets", [])]
            d["reapply"] = [ReapplySite(**r) for r in d.get("reapply", [])]
            return NormFold(**d)

        return cls(
            act_swaps=[ActSwap(**a) for a in data.get("act_swaps", [])],
            norm_folds=[norm(n) for n in data.get("norm_folds", [])],
            gated_mlps=[GatedMLPSwap(**g) for g in data.get("gated_mlps", [])],
            skips=[Skip(**s) for s in data.get("skips", [])],
            already_converted=list(data.get("already_converted", [])),
            probe_tokens=data.get("probe_tokens", 0),
            probe_unit=data.get("probe_unit", "token"),
            options=dict(data.get("options", {})),
        )
