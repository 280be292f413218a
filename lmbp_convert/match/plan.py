"""A conversion plan: plain, printable, serialisable data shared by ``convert()`` and the checkpoint CLI.

The plan is a list of *plan items*, one class per rewrite kind, all deriving from `PlanItem`: an item describes
itself for the report, predicts the activation bytes it saves, serialises, and builds its reversible unit
(`PlanItem.build_unit`). Everything that handles plans — ``convert()``, verification and rollback, the report,
the checkpoint CLI — loops over items and never names a kind, so a new rewrite is a new item class declared with
its matcher and builder in one `lmbp_convert.match.kinds.register_kind`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, TypeVar

from ..deprecation import renamed_attribute
from ..enums import BetaMode, Layout, NormType, ReapplyKind, WeightParam
from ..reasons import Reason
from .kinds import by_tag, item_classes

if TYPE_CHECKING:  # apply imports match, never the reverse: the builder is only a type here
    from ..apply.rewrite import Unit, UnitBuilder

T = TypeVar("T", bound="PlanItem")


@dataclass
class PlanItem:
    """One planned rewrite of one module. Subclasses are dataclasses that add their fields and a
    ``predicted_saved_bytes: int`` field (activation bytes the rewrite saves on the probe forward)."""

    tag: ClassVar[str] = ""  # its section in a serialised plan ("norm_folds"); unique among kinds
    noun: ClassVar[str] = ""  # plural for the report's summary line ("norms (exact)")
    noun_one: ClassVar[str] = ""  # singular ("norm (exact)"; "": the plural serves for one too)
    heading: ClassVar[str] = ""  # first line of its report section
    counted_when_none: ClassVar[bool] = False  # the report's summary line says "0 <noun>" (default: only if any)
    #: why training through this rewrite differs from the original's ("": the original parameters get the original
    #: gradients, up to rounding). The report names every such rewrite, so an inexact one is never silent; an item
    #: whose own case differs says so in `training_differs`.
    inexact_training: ClassVar[str] = ""
    #: serialised field names this kind's plans were written with before a rename → today's (read by `from_dict`;
    #: the old name also stays readable as an attribute for one minor version, with a DeprecationWarning)
    former_fields: ClassVar[dict[str, str]] = {}
    #: what one run of this rewrite is, for counting which rewrites ran (`lmbp_convert.apply.runs.count_runs`): ""
    #: a forward of module ``name``; else a call of that module's instance attribute of this name (the loss)
    called_as: ClassVar[str] = ""

    name: str  # the module rewritten
    cls: str  # its class (catalogue key)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in cls.__dict__.get("former_fields", {}).items():
            if old not in cls.__dict__ and old not in cls.__dict__.get("__annotations__", {}):
                setattr(cls, old, renamed_attribute(old, new))

    @classmethod
    def counted(cls, n: int) -> str:
        """``n`` of this kind for the report's summary line: "1 loss", "2 losses"."""
        return f"{n} {cls.noun_one if n == 1 and cls.noun_one else cls.noun}"

    def training_differs(self) -> str:
        """Why training through this item differs from the original's ("": it does not): the kind's
        `inexact_training`, unless the item knows better (a fold into frozen weights trains nothing differently)."""
        return self.inexact_training

    def claims(self) -> set[str]:
        """Modules this rewrite takes over: matchers that run later leave them alone."""
        return {self.name}

    def describe(self) -> list[str]:
        """Its lines in the report (indented by two spaces)."""
        return [f"  {self.name} ({self.cls.split(':')[-1]})"]

    @classmethod
    def report_lines(cls, items: list["PlanItem"]) -> list[str]:
        """The report section for this kind's items (never called with none)."""
        return [f"{cls.heading or cls.noun}:"] + [line for it in items for line in it.describe()]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PlanItem":
        return cls(**renamed(cls, data))

    def build_unit(self, builder: "UnitBuilder") -> "Unit":
        """The reversible rewrite of a live model (`lmbp_convert.apply.rewrite.Unit`). The builder finds the
        function registered for this class (``lmbp_convert.apply.rewrite.builds``), since this layer cannot
        import modules or kernels; an item defined outside the package may override this method instead."""
        return builder.build(self)


def renamed(cls: type[PlanItem], data: dict) -> dict:
    """``data`` with the field names ``cls`` used to write (`PlanItem.former_fields`) under today's names."""
    return {cls.former_fields.get(k, k): v for k, v in data.items()}


@dataclass
class LinearTarget:
    name: str
    layout: Layout
    via: list[str] = field(default_factory=list)  # commuting ops between the norm and this Linear
    adds_bias: bool = False  # the Linear has no bias but the norm has β
    base: str | None = None  # LoRA-wrapped Linear: attribute of the base layer (folded like a Linear) ...
    lora_adapters: list[str] = field(default_factory=list)  # ... and adapters whose lora_A gets A·diag(γ)
    lora_a_attr: str | None = None
    unseen: bool = False  # not run by the probe: a sibling of consumers in the same ModuleList/ModuleDict
    #: the parameter of module ``name`` the fold goes into: "weight" for Linear layers; another name for a weight
    #: a module applies through an op itself (MoE experts stacked in one 3-D parameter, "gate_up_proj"), whose
    #: bias is never touched (such targets are planned only for norms without β)
    weight: str = "weight"
    through_op: bool = False  # a parameter the module applies itself (F.linear, bmm, grouped_mm), not a Linear

    def __post_init__(self) -> None:
        self.layout = Layout(self.layout)

    @property
    def weight_key(self) -> str:
        """The qualified name of the weight folded into (``name.weight`` for a Linear)."""
        return f"{self.name}.{self.weight}" if self.name else self.weight

    @property
    def label(self) -> str:
        """How the report names it: the Linear, or the parameter where it is not a Linear's weight."""
        return self.name if self.weight == "weight" and not self.through_op else self.weight_key


@dataclass
class BiasPart:
    """Output rows [start, stop) of an op's bias come from the 1-D parameter or buffer ``tensor``."""

    tensor: str
    start: int
    stop: int
    parameter: bool = True  # False: a buffer (``persistent``: saved in the state dict)
    persistent: bool = True


@dataclass
class ParamTarget:
    """Rows [rows[0], rows[1]) (all: None) of the parameter ``weight`` read the norm's output through ``op``: the
    norm's γ folds into them; its β into the ``bias`` parts covering those rows (W·β, or Σ_k W·β for a conv)."""

    weight: str
    op: str  # "linear", "multi_head_attention_forward", "conv2d", ...
    scope: str  # the module the call runs in (the report)
    rows: list[int] | None = None
    bias: list[BiasPart] = field(default_factory=list)
    conv: bool = False

    def __post_init__(self) -> None:
        self.bias = [BiasPart(**b) if isinstance(b, dict) else b for b in self.bias]

    def describe(self) -> str:
        rows = f"[{self.rows[0]}:{self.rows[1]}]" if self.rows else ""
        parts = f" (+β into {', '.join(b.tensor for b in self.bias)})" if self.bias else ""
        return f"{self.weight}{rows} via {self.op} in {self.scope}{parts}"


@dataclass
class ReapplySite:
    """Where the folded-out affine is put back for a consumer that is not a folded Linear."""

    kind: ReapplyKind
    module: str  # module name ("" for the root)
    position: int | None = None
    keyword: str | None = None
    paths: list[list] = field(default_factory=list)  # for root_output: paths in the output structure
    consumer: str = ""

    def __post_init__(self) -> None:
        self.kind = ReapplyKind(self.kind)

    def describe(self) -> str:
        if self.kind is ReapplyKind.ROOT_OUTPUT:
            return f"model output {', '.join('.'.join(map(str, p)) for p in self.paths)}"
        slot = f"arg {self.position}" if self.keyword is None else f"{self.keyword}="
        return f"input {slot} of {self.module or '<model>'}"


@dataclass
class ActSwap(PlanItem):
    """An activation module swapped for an approximate-backprop one that keeps a ``bits``-bit code per element."""

    tag = "act_swaps"
    noun = "activations"
    noun_one = "activation"
    heading = "activations → approx-BP"
    inexact_training = "approximate backward: the derivative is a step function of the input"

    former_fields = {"kind": "act"}

    act: str  # the activation: an open set, the ops layer's table (lmbp_convert.ops.activations)
    bits: int
    predicted_saved_bytes: int = 0

    def describe(self) -> list[str]:
        return [f"  {self.name} ({self.cls.split(':')[-1]} → {self.act}, {self.bits} bits)"]

    @classmethod
    def report_lines(cls, items: list["ActSwap"]) -> list[str]:
        counts = Counter(f"{a.act}/{a.bits}-bit" for a in items)
        summary = f"{cls.heading}: " + ", ".join(f"{v}× {k}" for k, v in counts.items())
        return [summary] + [line for a in items for line in a.describe()]


@dataclass
class OutputActSwap(PlanItem):
    """An activation whose derivative is a function of its output (squared ReLU: 2·√y) swapped for one whose
    backward keeps only that output, the tensor the following Linear keeps anyway: exact, no code per element."""

    tag = "output_act_swaps"
    noun = "output-backward activations"
    noun_one = "output-backward activation"
    heading = "activations → memory-sharing (backward from the output)"

    former_fields = {"kind": "act"}

    act: str  # the ops layer's name of the activation (lmbp_convert.nn.activations.OUTPUT_KINDS)
    predicted_saved_bytes: int = 0

    def describe(self) -> list[str]:
        return [f"  {self.name} ({self.cls.split(':')[-1]} → {self.act}, keeps only its output)"]


@dataclass
class AffineNormItem(PlanItem):
    """The fields every rewrite of a norm with an affine shares (fold, kept affine, exact): not a kind itself."""

    former_fields = {"kind": "norm_type"}

    norm_type: NormType
    param: WeightParam
    eps: float
    shape: list[int]
    has_bias: bool

    def __post_init__(self) -> None:
        self.norm_type, self.param = NormType(self.norm_type), WeightParam(self.param)


@dataclass
class NormFold(AffineNormItem):
    """A norm swapped for a memory-sharing one, its affine folded into the Linears it feeds (``targets``) and
    re-applied for any other consumer (``reapply``)."""

    tag = "norm_folds"
    noun = "norms (folded)"
    noun_one = "norm (folded)"
    heading = "norms → memory-sharing (affine folded into)"
    inexact_training = ("affine folded: the optimiser trains the folded weights W·diag(γ) and W·β + b, not the norm's "
                        "γ, β and the original W, b")
    #: for a fold whose weights the checkpoint CLI already folded: convert() folds nothing, and only a norm γ, β
    #: that trained would differ (it becomes the fixed identity)
    prefolded_training: ClassVar[str] = ("weights folded on disk: the norm's γ, β become the fixed identity, so the "
                                         "optimiser no longer trains them")

    targets: list[LinearTarget] = field(default_factory=list)
    reapply: list[ReapplySite] = field(default_factory=list)
    caveats: list[str] = field(default_factory=list)
    predicted_saved_bytes: int = 0
    prefolded: bool = False  # weights already folded on disk (checkpoint CLI): swap only
    beta: BetaMode = BetaMode.FOLD
    out_dtype: str | None = None  # what the original cast its output to when unlike its input ("bfloat16")
    #: the parameters the rewrite changes (the norm's γ, β; unless prefolded the targets' W, b and LoRA A) that
    #: require grad when it is planned: none, and training is the original's (None: not known, a plan file)
    trainable: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.beta = BetaMode(self.beta)

    def training_differs(self) -> str:
        if self.trainable is not None and not self.trainable:
            return ""  # everything the fold touches is frozen (QLoRA's 4-bit weights, a LoRA base)
        return self.prefolded_training if self.prefolded else self.inexact_training

    # what a subclass that folds into more than Linears (`match.consumers.ConsumerFold`) overrides
    def param_targets(self) -> list[ParamTarget]:
        """Rows of parameters that functional ops apply, which take the fold too (none here)."""
        return []

    def channel_axis(self) -> int:
        """Where the norm's channels are (-1: last; 1: a channel-first norm on NCHW)."""
        return -1

    def buffer_notes(self) -> list[str]:
        """Buffers no state dict holds that take a part of β (a plain checkpoint cannot hold the fold)."""
        return []

    def _bracket(self) -> str:
        return f"{self.norm_type}, {self.param}"

    def _head(self) -> str:
        into = ", ".join(t.label + (" (+bias)" if t.adds_bias else "") + (" (not run by the probe)" if t.unseen else "")
                         for t in self.targets) or "nothing to fold"
        tag = " [weights already folded]" if self.prefolded else ""
        return f"  {self.name} [{self._bracket()}] → {into}{tag}"

    def describe(self) -> list[str]:
        lines = [self._head()]
        lines += [f"      affine re-applied at {r.describe()}" for r in self.reapply]
        return lines + [f"      note: {c}" for c in self.caveats]

    @classmethod
    def from_dict(cls, data: dict) -> "NormFold":
        d = renamed(cls, data)
        d["targets"] = [LinearTarget(**t) for t in d.get("targets", [])]
        d["reapply"] = [ReapplySite(**r) for r in d.get("reapply", [])]
        return cls(**d)


@dataclass
class NormSwap(PlanItem):
    """A norm without affine (no weight, no bias) swapped for a memory-sharing one: nothing to fold, its output
    is kept for backward instead of its input, and the Linears reading it (``readers``) share that storage."""

    tag = "norm_swaps"
    noun = "affine-free norms"
    noun_one = "affine-free norm"
    heading = "affine-free norms → memory-sharing (nothing to fold)"

    former_fields = {"kind": "norm_type"}

    norm_type: NormType
    eps: float
    shape: list[int]
    readers: list[str] = field(default_factory=list)  # Linears that keep the same output for their backward
    predicted_saved_bytes: int = 0

    def __post_init__(self) -> None:
        self.norm_type = NormType(self.norm_type)

    def describe(self) -> list[str]:
        return [f"  {self.name} [{self.norm_type}, no affine, eps={self.eps:g}] → output shared with "
                f"{', '.join(self.readers)}"]


@dataclass
class GatedMLPSwap(PlanItem):
    """A gated MLP (act(gate(x))·up(x) → down) replaced by the memory-sharing fused op over the same
    projection modules."""

    tag = "gated_mlps"
    noun = "gated MLPs"
    noun_one = "gated MLP"
    heading = "gated MLPs → memory-sharing fused op"

    act: str  # activation kind
    act_module: str
    gate: str | None
    up: str | None
    gate_up: str | None
    down: str
    gate_first: bool = True
    predicted_saved_bytes: int = 0
    pre_down: list[str] = field(default_factory=list)  # children run between the product and down (dropout, norm)
    post_down: list[str] = field(default_factory=list)  # children run on down's output (dropout, identity)
    cast_to_down: bool = False  # the product is cast to the down projection's weight dtype (T5's fp32 ``wo``)

    def claims(self) -> set[str]:
        return {self.name, self.act_module}  # its activation is computed inside the fused op

    def describe(self) -> list[str]:
        lay = self.gate_up if self.gate_up else f"{self.gate}, {self.up}"
        chain = [*self.pre_down, *(["cast"] if self.cast_to_down else []), self.down, *self.post_down]
        return [f"  {self.name} ({self.act}; {lay} → {' → '.join(chain)})"]


@dataclass
class Skip:
    """A module a matcher looked at and left as it is, and why (`Reason`: code, subject, sentence)."""

    name: str
    cls: str
    why: Reason

    @property
    def reason(self) -> str:
        """The sentence the report prints."""
        return self.why.text

    def to_dict(self) -> dict:
        return {"name": self.name, "cls": self.cls, "reason": self.why.text, **self.why.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "Skip":
        return cls(data["name"], data["cls"], Reason.from_dict(data["reason"], data))


#: fields of a serialised plan that are not item sections
_PLAN_FIELDS = ("skips", "already_converted", "probe_tokens", "probe_unit", "options", "notes", "measurement")


@dataclass
class Measurement:
    """Saved-for-backward bytes of one training forward on the probe (the exact ledger), ``before`` and ``after``
    the rewrites, in ``mode`` (dtype, autocast, train mode, what trains), on ``inputs`` (the probe's shapes and
    dtypes).
    Where activation checkpointing is on (``checkpointing``: by what, on how many modules), checkpointed layers
    keep only their inputs in that forward: ``without_checkpointing`` is the same forward with it off (what a
    layer keeps while it is recomputed in backward, summed over the layers)."""

    before: int
    after: int
    mode: str
    inputs: str
    checkpointing: str = ""
    without_checkpointing: tuple[int, int] | None = None
    #: how it was taken: "convert" (before the first rewrite and after verification) or "plan" (the plan applied
    #: and undone, unverified: `lmbp_convert.plan_conversion`)
    by: str = "convert"

    def __post_init__(self) -> None:
        if self.without_checkpointing is not None:
            self.without_checkpointing = tuple(self.without_checkpointing)

    @property
    def saved(self) -> int:
        return self.before - self.after


@dataclass
class Plan:
    """The items in the order their units are applied (gated MLPs, norms, activations: matcher order), the
    skips with their reasons, and what the plan was made from. ``probe`` and ``reference_output`` (the probe
    forward's output, which verification compares with) are run-time data: not serialised, not compared; so is
    ``probe_index``, where the automatic probe stood among the candidates (a second seed starts there)."""

    items: list[PlanItem] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    already_converted: list[str] = field(default_factory=list)
    probe_tokens: int = 0
    probe_unit: str = "token"
    options: dict = field(default_factory=dict)
    #: what the matchers found worth saying that is neither an item nor a skip (LoRA layers with nothing to share)
    notes: list[str] = field(default_factory=list)
    #: the bytes the plan saves, measured by applying it and undoing it (`plan_conversion`); None: not measured
    measurement: Measurement | None = field(default=None, compare=False)
    #: why nothing was measured ("": it was, or nobody tried)
    unmeasured_why: str = field(default="", compare=False)
    probe: Any = field(default=None, repr=False, compare=False)
    reference_output: Any = field(default=None, repr=False, compare=False)
    probe_index: int = field(default=0, repr=False, compare=False)  # the automatic probe's place among candidates

    def __iter__(self) -> Iterator[PlanItem]:
        return iter(self.items)

    def of(self, kind: type[T]) -> list[T]:
        """The items of exactly this class, in plan order."""
        return [it for it in self.items if type(it) is kind]

    def kinds(self) -> list[type[PlanItem]]:
        """Every registered kind (report order), then any unregistered kind the plan holds."""
        known = item_classes()
        return known + list(dict.fromkeys(type(it) for it in self.items if type(it) not in known))

    # read-only views by kind, kept for code written against the three fixed lists
    @property
    def act_swaps(self) -> list[ActSwap]:
        return self.of(ActSwap)

    @property
    def norm_folds(self) -> list[NormFold]:
        return self.of(NormFold)

    @property
    def gated_mlps(self) -> list[GatedMLPSwap]:
        return self.of(GatedMLPSwap)

    @property
    def empty(self) -> bool:
        return not self.items

    @property
    def predicted_saved_bytes(self) -> int:
        return sum(it.predicted_saved_bytes for it in self.items)

    def drop(self, item: PlanItem, reason: Reason) -> None:
        """Take ``item`` out of the plan and record why (a rewrite rolled back after verification)."""
        self.items = [it for it in self.items if it is not item]
        self.skips.append(Skip(item.name, item.cls, reason))

    def to_dict(self) -> dict:
        """One list per kind under its tag (sections in plan order, then the kinds it has none of): the layout
        plans have always had, so earlier plan files read back."""
        out: dict[str, Any] = {}
        for it in self.items:
            out.setdefault(it.tag, []).append(it.to_dict())
        for kind in item_classes():
            out.setdefault(kind.tag, [])
        out["skips"] = [s.to_dict() for s in self.skips]
        out.update(already_converted=list(self.already_converted), probe_tokens=self.probe_tokens,
                   probe_unit=self.probe_unit, options=dict(self.options), notes=list(self.notes))
        if self.measurement is not None:
            out["measurement"] = asdict(self.measurement)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        items: list[PlanItem] = []
        for key, entries in data.items():
            if key in _PLAN_FIELDS or key in {f.name for f in fields(cls)}:
                continue
            kind = by_tag(key)
            if kind is None:
                known = ", ".join(k.tag for k in item_classes())
                raise ValueError(f"the plan has items of unknown kind {key!r} (known: {known}); register that kind "
                                 "first (lmbp_convert.match.kinds.register_kind)")
            items += [kind.from_dict(d) for d in entries]
        return cls(
            items=items,
            skips=[Skip.from_dict(s) for s in data.get("skips", [])],
            already_converted=list(data.get("already_converted", [])),
            probe_tokens=data.get("probe_tokens", 0),
            probe_unit=data.get("probe_unit", "token"),
            options=dict(data.get("options", {})),
            notes=list(data.get("notes", [])),
            measurement=Measurement(**data["measurement"]) if data.get("measurement") else None,
        )
