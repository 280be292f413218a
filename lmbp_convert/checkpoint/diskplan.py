"""From the walker's plan to what happens on disk: which rewrites a plain checkpoint can hold, and what each
output tensor is made of. Pure decisions, no tensor data read.

The planner loops over the plan's items and asks each kind's `DiskRule` (`RewriteKind.disk`) whether and how the item
rewrites stored tensors. A kind without a rule is a module swap only, which ``convert()`` makes when it loads
the written checkpoint; today only norm folds change weights.

Files: the output's data classes are `disk_actions`, the kinds' rules `disk_rules` (both re-exported here); this
file holds the `DiskPlan` and the planner.
"""
from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable

from ..apply.convert import CONFIG_KEY
from ..match.kinds import declared
from ..match.plan import Plan, PlanItem, Skip
from ..reasons import Reason, ReasonCode
from ..report import fmt_bytes
# What is written (data) and the kinds' rules, re-exported: this module is the disk plan's one import.
from .disk_actions import STORED, Action, ActionKind, OutShard, OutTensor  # noqa: F401
from .disk_rules import ConsumerFoldOnDisk, DiskRule, FoldOnDisk  # noqa: F401
from .errors import CheckpointError
from .models import KeyMap, ModelSource, ModelView, map_keys
from .sources import Source, unindexed_key

SAFETENSORS_INDEX = "model.safetensors.index.json"

#: what the plan says of the bytes saved: it is made on the meta device, and a fold on disk saves nothing by itself
MEASURED_BY_CONVERT = ("measured by convert() on the model loaded from DST, in the mode it trains in (this plan is "
                       "made on the meta device, without weights to measure with; the folds on disk save nothing "
                       "until convert() swaps the norms)")


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
        """The folds' per-rewrite analytic estimate: not printed (the plan is made on the meta device, and what
        convert() saves on the loaded model is its measurement of every rewrite, not of the folds alone)."""
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
        lines.append(f"activation memory saved: {MEASURED_BY_CONVERT}")
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


def _rule(item: PlanItem) -> DiskRule | None:
    """The disk rule the item's kind declares (`match.kinds.RewriteKind.disk`; exactly its class's)."""
    kind = declared(type(item), exact=True)
    return kind.disk if kind is not None else None


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
def plan_disk(src: Source, view: ModelView, plan: Plan, *, untie: bool, raw_config: dict | None,
              make_view: Callable[[dict], ModelView] | None, out_name: Callable[[str], str],
              options: dict) -> DiskPlan:
    """Decide which of ``plan``'s items go on disk and how each output tensor is made."""
    return _Planner(src, view, plan, untie, raw_config, make_view, out_name, options).run()


def record_json(record: dict) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"))
