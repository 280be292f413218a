"""From the walker's plan to what happens on disk: which rewrites a plain checkpoint can hold, and what each
output tensor is made of. Pure decisions, no tensor data read.

The planner loops over the plan's items and asks each kind's `DiskRule` (`RewriteKind.disk`) whether and how the item
rewrites stored tensors. A kind without a rule is a module swap only, which ``convert()`` makes when it loads
the written checkpoint; today only norm folds change weights.
"""
from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..apply.convert import CONFIG_KEY
from ..enums import Layout, StrChoice, WeightParam
from ..match.consumers import ConsumerFold
from ..match.kinds import declared
from ..match.plan import LinearTarget, NormFold, Plan, PlanItem, Skip
from ..reasons import Reason, ReasonCode
from ..report import fmt_bytes
from .errors import CheckpointError
from .models import KeyMap, ModelSource, ModelView, map_keys
from .sources import Source, unindexed_key

SAFETENSORS_INDEX = "model.safetensors.index.json"


class ActionKind(StrChoice):
    IDENTITY = "identity"  # a folded norm's weight: the identity of its parameterisation
    ZERO = "zero"  # a folded norm's bias
    FOLD_W = "fold_w"  # a Linear's weight: W·diag(γ)
    FOLD_B = "fold_b"  # a Linear's bias: b + W·β


@dataclass
class Action:
    """How an output tensor is computed from the source (keys are source checkpoint keys)."""

    kind: ActionKind
    norm: str
    param: WeightParam = WeightParam.W  # the norm's parameterisation
    layout: Layout = Layout.OUT_IN
    gamma: str | None = None
    beta: str | None = None
    weight: str | None = None  # the Linear's original weight (fold_b needs it: b' = b + W·β)


@dataclass
class OutTensor:
    key: str  # name in DST
    source: str  # source key its data comes from
    action: Action | None = None


@dataclass
class OutShard:
    name: str
    source: str
    tensors: list[OutTensor] = field(default_factory=list)


@dataclass
class DiskPlan:
    """Everything lmbp-convert will write, decided before the first byte is: folds, skips with reasons, and per
    output shard the tensors with how each is made."""

    view: ModelView
    plan: Plan
    folds: list[PlanItem]  # the items written into the tensors (norm folds)
    skips: list[Skip]
    shards: list[OutShard]
    record: dict
    nbytes: dict[str, int]  # output key → bytes
    dtype: str  # activation dtype the per-token estimate assumes
    index_name: str | None = None
    index: dict | None = None
    config: dict | None = None
    untied: list[str] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)
    not_copied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds_plan: float = 0.0  # reading headers, building the meta model, tracing, deciding
    #: where seconds_plan went: "imports" (transformers / timm and the model's code), "model" (built on meta),
    #: "trace" (plan_conversion), "disk" (headers and the disk plan)
    plan_phases: dict = field(default_factory=dict)
    seconds_write: float = 0.0  # streaming the tensors and writing DST
    committed: bool = False  # DST is complete and in place

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    @property
    def predicted_saved_bytes(self) -> int:
        return sum(f.predicted_saved_bytes for f in self.folds)

    @property
    def saved_per_unit(self) -> float:
        return self.predicted_saved_bytes / max(1, self.plan.probe_tokens)

    def to_dict(self) -> dict:
        return {
            "architecture": self.view.arch,
            "folds": [_rule(f).summary(f) for f in self.folds],
            "skips": [s.to_dict() for s in self.skips],
            "untied": list(self.untied),
            "predicted_saved_bytes_per_" + self.plan.probe_unit: self.saved_per_unit,
            "activation_dtype": self.dtype,
            "shards": [{"name": s.name, "tensors": len(s.tensors),
                        "bytes": sum(self.nbytes[t.key] for t in s.tensors)} for s in self.shards],
            "total_bytes": self.total_bytes,
            "copies": list(self.copies),
            "not_copied": list(self.not_copied),
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        lines = [f"lmbp-convert plan for {self.view.arch}: {len(self.folds)} norm(s) folded into the following "
                 f"Linear layers, {len(self.skips)} skipped"]
        lines += [_rule(f).describe(f) for f in self.folds]
        for s in self.skips:
            lines.append(f"  skip {s.name}: {s.reason}")
        for u in self.untied:
            lines.append(f"  untie {u}: written as its own tensor (tie_word_embeddings -> false)")
        lines.append(f"predicted activation memory saved once convert() swaps these norms for fine-tuning: "
                     f"{fmt_bytes(self.saved_per_unit)} per {self.plan.probe_unit} ({self.dtype} activations)")
        n = sum(len(s.tensors) for s in self.shards)
        lines.append(f"writes {len(self.shards)} shard(s), {n} tensors, {fmt_bytes(self.total_bytes)}"
                     + (f"; copies {', '.join(self.copies)}" if self.copies else ""))
        if self.not_copied:
            lines.append(f"not copied: {', '.join(self.not_copied)}")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _untie_config(raw: dict) -> dict:
    out = copy.deepcopy(raw)
    out["tie_word_embeddings"] = False
    for sub in ("text_config", "decoder"):
        if isinstance(out.get(sub), dict) and "tie_word_embeddings" in out[sub]:
            out[sub]["tie_word_embeddings"] = False
    return out


def _on_disk(text: str) -> Reason:
    return Reason(ReasonCode.ON_DISK, text)


class _Planner:
    def __init__(self, src: Source, view: ModelView, plan: Plan, untie: bool, raw: dict | None,
                 make_view: Callable[[dict], ModelView] | None, out_name: Callable[[str], str],
                 options: dict) -> None:
        self.src, self.view, self.plan, self.untie, self.raw = src, view, plan, untie, raw
        self.make_view, self.out_name, self.options = make_view, out_name, options
        # the walker's reasons name the CLI's flags: `plan_checkpoint` plans under `reasons.cli_spelling`
        self.skips = list(plan.skips)
        self.km: KeyMap = map_keys(view, list(src.infos), lambda k: src.infos[k].shard)
        self.stored = self.km.stored()
        for k, m in self.km.plain.items():
            shape = view.state[m][0]
            if src.infos[k].shape != shape:
                raise CheckpointError(f"tensor {k!r} in {src.infos[k].shard} has shape {list(src.infos[k].shape)}, "
                                      f"but the config expects {list(shape)} for {m}")
        self._check_nothing_missing()

    def _check_nothing_missing(self) -> None:
        """Every parameter the model has must come from the checkpoint (itself, a tied twin, or a load-time
        converter): a DST missing one would load with freshly initialised weights, e.g. a config.json that
        describes more layers than the checkpoint holds."""
        have = set(self.km.plain.values()) | set(self.km.converted.values())
        ignore = getattr(self.view.model, "_keys_to_ignore_on_load_missing", None) or []
        ignore_re = re.compile("|".join(f"({p})" for p in ignore)) if ignore else None
        missing = []
        for name, _ in self.view.model.named_parameters():
            if self.view.group(name) & have or (ignore_re is not None and ignore_re.search(name)):
                continue
            missing.append(name)
        if not missing:
            return
        if self.src.index_name is not None:
            for name in missing:
                held_in = unindexed_key(self.src, name)
                if held_in is not None:
                    raise CheckpointError(f"{self.src.index_name} does not list tensor {name!r}: it is in "
                                          f"{held_in}, a shard the index does not name (incomplete or stale index)")
        layers = sorted({int(m.group(1)) for n in missing for m in [re.search(r"\.(\d+)\.", n)] if m})
        hint = (f"; does config.json describe more layers than the checkpoint holds (no tensors for layer(s) "
                f"{', '.join(map(str, layers[:5]))}{'...' if len(layers) > 5 else ''})?" if layers else
                "; is config.json from another model?")
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensor(s) that {self.view.arch} expects, e.g. "
                              f"{missing[0]!r}{hint}")

    # -- lookups --------------------------------------------------------------------------------------------
    def key_of(self, name: str) -> str | None:
        """The source key holding model tensor ``name`` (itself or a tied twin), if stored plainly."""
        if name in self.stored:
            return self.stored[name]
        for n in sorted(self.view.group(name)):
            if n in self.stored:
                return self.stored[n]
        return None

    def _tensor_problem(self, name: str) -> str | None:
        k = self.key_of(name)
        if k is None:
            return (f"{name} is not stored as a plain tensor in the checkpoint (missing, or produced by a load-time "
                    "weight conversion)")
        if not self.src.infos[k].is_float:
            return f"{name} is stored as {self.src.infos[k].dtype} (quantized or integer), which cannot be rewritten"
        return None

    # -- decisions -------------------------------------------------------------------------------------------
    def run(self) -> DiskPlan:
        cands = self._candidates()
        dst_view, dst_raw, cands = self._untie(cands)
        claims: dict[str, Action] = {}
        written: list[PlanItem] = []
        for item, _ in cands:
            rule = _rule(item)
            acts = rule.actions(self, item)
            problem = self._claim_problem(item, rule.targets(item), acts, dst_view, claims)
            if problem:
                self.skips.append(Skip(item.name, item.cls, _on_disk(problem)))
                continue
            claims.update(acts)
            written.append(item)
        return self._outputs(written, claims, dst_view, dst_raw)

    def _candidates(self) -> list[tuple[PlanItem, bool]]:
        """(item, needs untying) for every item whose kind rewrites tensors and that a plain checkpoint can hold;
        a skip with its reason for the others."""
        cands = []
        for item in self.plan.items:
            rule = _rule(item)
            if rule is None:
                continue  # a module swap only: convert() makes it when it loads the checkpoint
            reason, needs_untie = rule.problem(self, item)
            if reason:
                self.skips.append(Skip(item.name, item.cls, _on_disk(reason)))
            else:
                cands.append((item, needs_untie))
        return cands

    def _untie(self, cands: list[tuple[PlanItem, bool]]) -> tuple[ModelView, dict | None, list]:
        """(DST view, DST config, candidates kept) once the items that need an untied head are settled."""
        if not any(u for _, u in cands):
            return self.view, self.raw, cands
        dst_raw, dst_view, why = self._untied_view()
        keep = []
        for item, u in cands:
            tied = [f"{t}.weight" for t in _rule(item).targets(item)
                    if len(dst_view.group(f"{t}.weight")) > 1]
            if u and why:
                self.skips.append(Skip(item.name, item.cls, _on_disk(why)))
            elif u and tied:
                self.skips.append(Skip(item.name, item.cls, Reason(
                    ReasonCode.TIED_WEIGHT, f"{tied[0]} stays tied to "
                    f"{', '.join(sorted(dst_view.group(tied[0]) - {tied[0]}))} even with tie_word_embeddings=false",
                    tied[0])))
            else:
                keep.append((item, u))
        if not any(u for _, u in keep):
            return self.view, self.raw, keep
        return dst_view, dst_raw, keep

    def _untied_view(self) -> tuple[dict | None, ModelView, str | None]:
        """(DST config, DST model view, reason why untying is impossible or None)."""
        if self.raw is None or self.make_view is None:
            return self.raw, self.view, "the head is tied and only a Hugging Face config can untie it"
        raw = _untie_config(self.raw)
        view = self.make_view(raw)
        if set(view.state) != set(self.view.state):
            return self.raw, self.view, "tie_word_embeddings=false changes this model's tensors; cannot untie it"
        return raw, view, None

    @staticmethod
    def _claim_problem(item: PlanItem, targets: list[str], acts: dict[str, Action], dst: ModelView,
                       claims: dict[str, Action]) -> str | None:
        """Why the tensors ``item`` rewrites cannot be (shared with a layer it does not rewrite, or already
        rewritten by another item)."""
        for name in acts:
            group = dst.group(name)
            if name.startswith(item.name + ".") and len(group) > 1:
                return f"{name} is shared with {', '.join(sorted(group - {name}))}"
            for other in sorted(group - {name}):
                owner = other.rsplit(".", 1)[0]
                if owner in dst.linear_like and not any(other.startswith(t + ".") for t in targets):
                    return f"{name} is shared with {other}, another layer that the fold would change"
            for member in group:
                if member in claims:
                    return f"{member} is already rewritten by the fold of {claims[member].norm}"
        return None

    # -- outputs ---------------------------------------------------------------------------------------------
    def _outputs(self, written: list[PlanItem], claims: dict[str, Action], dst: ModelView,
                 dst_raw: dict | None) -> DiskPlan:
        shards, nbytes = self._shards(claims, dst)
        untied = self._untied_tensors(shards, nbytes, claims, dst)
        record = self._record(written, untied)
        config = None
        if dst_raw is not None:
            config = copy.deepcopy(dst_raw)
            config[CONFIG_KEY] = record
        out_shards = [shards[s] for s in self.src.shards]
        index_name, index = self._index(out_shards, nbytes, untied)
        dtype = next((str(p.dtype).replace("torch.", "") for p in self.view.model.parameters()
                      if p.is_floating_point()), "float32")
        return DiskPlan(self.view, self.plan, written, self.skips, out_shards, record, nbytes, dtype, index_name,
                        index, config, untied, notes=self._notes(written))

    def _shards(self, claims: dict[str, Action], dst: ModelView) -> tuple[dict[str, OutShard], dict[str, int]]:
        """Per source shard, its tensors and how each is made (output key → bytes alongside)."""
        shards: dict[str, OutShard] = {}
        nbytes: dict[str, int] = {}
        for s in self.src.shards:
            out = shards[s] = OutShard(self.out_name(s), s)
            for info in self.src.shard_tensors(s):
                act = None
                m = self.km.plain.get(info.key)
                if m is not None:
                    act = next((claims[n] for n in sorted(dst.group(m)) if n in claims), None)
                elif info.key in self.km.converted:  # part of a model tensor a load-time converter makes
                    act = claims.get(STORED + info.key)
                out.tensors.append(OutTensor(info.key, info.key, act))
                nbytes[info.key] = info.nbytes
        return shards, nbytes

    def _untied_tensors(self, shards: dict[str, OutShard], nbytes: dict[str, int], claims: dict[str, Action],
                        dst: ModelView) -> list[str]:
        """Tensors that untying splits off a stored twin: written explicitly, next to their source."""
        untied: list[str] = []
        written = set(self.km.plain.values())
        for group in sorted({g for g in dst.groups.values()}, key=lambda g: sorted(g)):
            if group & written:
                continue
            src_group = frozenset().union(*(self.view.group(n) for n in group))
            if src_group == group:
                continue  # not split by untying: missing in SRC as well, loaded (or not) as SRC would be
            name = next((n for n in sorted(group) if n in claims), sorted(group)[0])
            key = self.key_of(name)
            if key is None:
                continue
            if name in nbytes:
                raise CheckpointError(f"cannot add untied tensor {name!r}: the checkpoint already has a tensor "
                                      "of that name")
            shards[self.src.infos[key].shard].tensors.append(OutTensor(name, key, claims.get(name)))
            nbytes[name] = self.src.infos[key].nbytes
            untied.append(name)
            written |= group
        return untied

    def _record(self, written: list[PlanItem], untied: list[str]) -> dict:
        """What config.json records of the conversion (earlier folds of a converted SRC included)."""
        from .. import __version__

        record = {
            "version": __version__,
            "folded_norms": [f.name for f in written],
            "architecture": self.view.arch,
            "options": self.options,
            "untied": untied,
        }
        prev = (self.raw or {}).get(CONFIG_KEY)
        if isinstance(prev, dict) and prev.get("folded_norms"):
            earlier = [n for n in prev["folded_norms"] if n not in record["folded_norms"]]
            record["folded_norms"] = earlier + record["folded_norms"]
            record["untied"] = list(dict.fromkeys([*prev.get("untied", []), *untied]))
        return record

    def _index(self, out_shards: list[OutShard], nbytes: dict[str, int],
               untied: list[str]) -> tuple[str | None, dict | None]:
        src = self.src
        if src.index is None:
            return None, None
        meta = dict(src.index.get("metadata") or {}) if src.fmt == "safetensors" else {}
        meta["total_size"] = sum(nbytes.values())
        if isinstance(meta.get("total_parameters"), int):  # untied tensors are parameters of their own now
            meta["total_parameters"] += sum(math.prod(src.infos[t.source].shape)
                                            for s in out_shards for t in s.tensors if t.key in untied)
        return SAFETENSORS_INDEX, {"metadata": meta, "weight_map": {t.key: s.name for s in out_shards
                                                                    for t in s.tensors}}

    def _notes(self, written: list[PlanItem]) -> list[str]:
        notes = []
        if written:
            where = ("output_hidden_states, or another head class on the same weights" if self.view.kind is ModelSource.HF
                     else "forward_features, or a reset/removed head")
            notes.append(f"DST reproduces the outputs of {self.view.arch}; features read right after a folded "
                         f"norm ({where}) lack its affine")
        if self.km.ignored:
            notes.append(f"{len(self.km.ignored)} tensor(s) the model ignores on load copied as they are "
                         f"(e.g. {self.km.ignored[0]})")
        return notes


# -- rules per plan item kind ------------------------------------------------------------------------------------
class DiskRule(Protocol):
    """How the items of one kind go into a plain checkpoint."""

    def problem(self, p: _Planner, item: PlanItem) -> tuple[str | None, bool]:
        """(why a plain checkpoint cannot hold it or None, whether it needs an untied head)."""

    def actions(self, p: _Planner, item: PlanItem) -> dict[str, Action]:
        """Model tensor name → how its output tensor is made."""

    def targets(self, item: PlanItem) -> list[str]:
        """The other layers whose tensors it rewrites."""

    def summary(self, item: PlanItem) -> dict:
        """Its entry in the disk plan's JSON."""

    def describe(self, item: PlanItem) -> str:
        """Its line in the printed disk plan."""


class FoldOnDisk:
    """A norm fold: γ (and β) written into the following Linears, the norm's weight set to the identity."""

    def problem(self, p: _Planner, f: NormFold) -> tuple[str | None, bool]:
        if f.prefolded:
            return "already folded on disk (config.json records it)", False
        if f.reapply:
            where = "; ".join(r.describe() for r in f.reapply)
            return (f"its affine must be re-applied at run time for {where}, which a plain checkpoint cannot "
                    "express (convert() does it when it loads the model)"), False
        bare = next((t.name for t in f.targets if t.adds_bias), None)
        if bare is not None:
            return (f"{bare} has no bias to take the norm's shift (beta); the plain architecture cannot express "
                    "the fold"), False
        return self._tensor_problem(p, f)

    @staticmethod
    def _tensor_problem(p: _Planner, f: NormFold) -> tuple[str | None, bool]:
        names = [f"{f.name}.weight"] + ([f"{f.name}.bias"] if f.has_bias else [])
        needs_untie = False
        for t in f.targets:
            if t.through_op or t.weight != "weight":  # a parameter the module applies itself (MoE experts)
                problem = _param_sources(p, t, f.shape[0])
                if isinstance(problem, str):
                    return problem, False
                continue
            names.append(f"{t.name}.weight")
            if f"{t.name}.bias" in p.view.state:
                names.append(f"{t.name}.bias")
            w = p.view.state.get(f"{t.name}.weight")
            if w is None:
                return f"{t.name} has no weight tensor", False
            if len(w[0]) != 2 or [w[0][1] if t.layout is Layout.OUT_IN else w[0][0]] != list(f.shape):
                return f"{t.name}.weight has shape {list(w[0])}, which does not take {f.shape[0]} inputs", False
            if len(p.view.group(f"{t.name}.weight")) > 1:
                if not p.untie:
                    return f"{t.name}.weight is tied (--untie folds into an untied copy)", False
                needs_untie = True
        problem = next((pr for pr in map(p._tensor_problem, names) if pr), None)
        return (problem, False) if problem else (None, needs_untie)

    def actions(self, p: _Planner, f: NormFold) -> dict[str, Action]:
        gk = p.key_of(f"{f.name}.weight")
        bk = p.key_of(f"{f.name}.bias") if f.has_bias else None
        acts = {f"{f.name}.weight": Action(ActionKind.IDENTITY, f.name, f.param)}
        if f.has_bias:
            acts[f"{f.name}.bias"] = Action(ActionKind.ZERO, f.name, f.param)
        for t in f.targets:
            if t.through_op or t.weight != "weight":  # no bias: such targets are planned only without β
                for name, layout in _param_sources(p, t, f.shape[0]):
                    acts[name] = Action(ActionKind.FOLD_W, f.name, f.param, layout, gamma=gk)
                continue
            acts[f"{t.name}.weight"] = Action(ActionKind.FOLD_W, f.name, f.param, t.layout, gamma=gk)
            if f"{t.name}.bias" in p.view.state and bk is not None:
                acts[f"{t.name}.bias"] = Action(ActionKind.FOLD_B, f.name, f.param, t.layout, gamma=gk, beta=bk,
                                                weight=p.key_of(f"{t.name}.weight"))
        return acts

    def targets(self, f: NormFold) -> list[str]:
        return [t.name for t in f.targets]

    def summary(self, f: NormFold) -> dict:
        return {"norm": f.name, "norm_type": f.norm_type, "param": f.param, "into": [t.label for t in f.targets]}

    def describe(self, f: NormFold) -> str:
        kind = f"{f.norm_type}, {f.param}" + (", +bias" if f.has_bias else "")
        return f"  fold {f.name} [{kind}] -> {', '.join(t.label for t in f.targets)}"


#: prefix of an action's name for a checkpoint tensor that a load-time converter turns into part of a model tensor
STORED = "<stored>:"
#: converter operations that only stack or join whole tensors along a dim (transformers' MoE expert merges)
_JOINS = ("MergeModulelist", "Concatenate")


def _param_sources(p: _Planner, t: LinearTarget, d: int) -> list[tuple[str, Layout]] | str:
    """The checkpoint tensors holding a parameter target (MoE experts as one 3-D parameter): the parameter itself
    when stored as it is, or the per-expert tensors a load-time converter stacks into it (transformers ≥ 5 saves
    Mixtral / Qwen-MoE experts as ``experts.{e}.w1.weight`` …), each folded along its own input dim. Only joins
    that leave the input dim in place are followed; otherwise the reason why not."""
    name = t.weight_key
    key = p.key_of(name)
    if key is not None:
        info = p.src.infos[key]
        if len(info.shape) < 2 or info.shape[-1 if t.layout is Layout.OUT_IN else -2] != d:
            return f"{name} has shape {list(info.shape)}, which does not take {d} inputs"
        problem = p._tensor_problem(name)
        return problem if problem else [(name, t.layout)]
    sources = sorted(k for k, m in p.km.converted.items() if m == name)
    if not sources:
        return f"{name} is not in the checkpoint"
    for k in sources:
        info, ops = p.src.infos[k], p.km.operations.get(k)
        ndim = len(info.shape)
        if t.layout is not Layout.OUT_IN or ndim < 2 or info.shape[-1] != d or ops is None:
            return (f"{name} is made at load time from {k} {list(info.shape)} by a conversion the disk fold does "
                    "not follow (convert() folds it when it loads the model)")
        for op, dim in ops:  # each join must leave the input dim (the last) where it is
            out_ndim = ndim + 1 if op == "MergeModulelist" else ndim
            if op not in _JOINS or not isinstance(dim, int) or dim % out_ndim == out_ndim - 1:
                return (f"{name} is made at load time from {k} by {op}(dim={dim}), which the disk fold does not "
                        "follow (convert() folds it when it loads the model)")
            ndim = out_ndim
        if not info.is_float:
            return f"{k} is stored as {info.dtype} (quantized or integer), which cannot be rewritten"
    return [(STORED + k, Layout.OUT_IN) for k in sources]


class ConsumerFoldOnDisk(FoldOnDisk):
    """A norm folded into functional consumers (`ConsumerFold`): on disk only where each is a whole 2-D weight that
    F.linear applies (γ: W·diag(γ), as a Linear) and β, if any, goes into one whole bias parameter; rows of a
    weight (nn.MultiheadAttention's in_proj), bias pieces assembled in forward (EVA's q/k/v biases), convolutions
    and channel-first norms are refused with that reason (convert() folds them when it loads the checkpoint)."""

    def problem(self, p: _Planner, f: ConsumerFold) -> tuple[str | None, bool]:
        if f.channel_dim != -1:
            return "a channel-first norm: its memory-sharing form is made by convert() when it loads the model", False
        for t in f.params:
            why = self._param_problem(t)
            if why:
                return f"{t.describe()}: {why}; convert() folds it when it loads the model", False
        reason, untie = super().problem(p, f)
        if reason:
            return reason, untie
        names = [t.weight for t in f.params] + [b.tensor for t in f.params for b in t.bias]
        problem = next((pr for pr in map(p._tensor_problem, names) if pr), None)
        return (problem, False) if problem else (None, untie)

    @staticmethod
    def _param_problem(t) -> str | None:
        if t.conv:
            return "the on-disk fold does not rewrite convolutions"
        if t.rows:
            return "the on-disk fold rewrites whole weights, not a block of rows"
        if len(t.bias) > 1 or any(not b.parameter for b in t.bias):
            return "its bias is assembled in forward from several tensors"
        return None

    def actions(self, p: _Planner, f: ConsumerFold) -> dict[str, Action]:
        acts = super().actions(p, f)
        gk = p.key_of(f"{f.name}.weight")
        bk = p.key_of(f"{f.name}.bias") if f.has_bias else None
        for t in f.params:
            acts[t.weight] = Action(ActionKind.FOLD_W, f.name, f.param, Layout.OUT_IN, gamma=gk)
            for b in t.bias:
                acts[b.tensor] = Action(ActionKind.FOLD_B, f.name, f.param, Layout.OUT_IN, gamma=gk, beta=bk,
                                        weight=p.key_of(t.weight))
        return acts

    def targets(self, f: ConsumerFold) -> list[str]:
        return super().targets(f) + [t.weight.rpartition(".")[0] for t in f.params]


#: plan item class → how its items go on disk (kinds not listed are module swaps only)
def _rule(item: PlanItem) -> DiskRule | None:
    """The disk rule the item's kind declares (`match.kinds.RewriteKind.disk`; exactly its class's)."""
    kind = declared(type(item), exact=True)
    return kind.disk if kind is not None else None


def plan_disk(src: Source, view: ModelView, plan: Plan, *, untie: bool, raw_config: dict | None,
              make_view: Callable[[dict], ModelView] | None, out_name: Callable[[str], str],
              options: dict) -> DiskPlan:
    """Decide which of ``plan``'s items go on disk and how each output tensor is made."""
    return _Planner(src, view, plan, untie, raw_config, make_view, out_name, options).run()


def record_json(record: dict) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"))
