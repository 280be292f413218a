"""Run one probe forward and record the data flow (see ``graph.py``).

Tensor ops are seen through a ``TorchFunctionMode``; module calls through per-instance forward hooks that are
removed afterwards. Ops inside *leaf* modules (the ones the matcher cares about as a whole: Linear, norms,
activations, dropout, modules without children) are not recorded, so a Linear is one node, not its F.linear.
Works on real and meta tensors alike: nothing here reads tensor values. Model code that cannot run on meta
tensors as it is (older transformers: ``torch.autocast(device_type="meta")``, checks that read the values of
masks it built itself) is traced again with the meta device shown to it as the CPU (see ``_MetaAsCpu``).
"""
from __future__ import annotations

import inspect
from contextlib import ExitStack
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_map

from ..errors import TraceError
from .containers import children
from .graph import ArgSlot, Graph, Node, Callee, ScopeCall, TensorInfo

#: Out of memory (a device's or the host's): never "this input does not fit the model". The probe search, the
#: trace and verification re-raise it, so that a smaller probe cannot hide it and the report cannot misread it.
OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)

_INPLACE_EXCEPTIONS = {"__iadd__", "__isub__", "__imul__", "__itruediv__"}


_DEVICE_GETTER = torch.Tensor.device  # the getset descriptor: a mode sees `t.device` as a call of its __get__


def _is_cpu_device(obj: Any) -> bool:
    if isinstance(obj, torch.device):
        return obj.type == "cpu"
    return isinstance(obj, str) and obj.split(":")[0] == "cpu"


class _MetaAsCpu:
    """The second try on a meta model: its code sees meta tensors on the CPU (``t.device``), so tensors it makes
    "on the same device" (masks, positions, rotary tables) are real CPU tensors whose values its checks can read
    and an autocast region it opens is the CPU's. A CPU tensor that meets a meta tensor in an op is moved to the
    meta device, and moving a meta tensor "to the CPU" keeps it on the meta device: only values that do not
    depend on weights are ever computed, at the probe's size. A meta probe has no values: its integer and bool
    tensors are shown as ones (a valid token id, an all-attending mask); its float tensors meet the weights at
    once and stay on the meta device."""

    @staticmethod
    def probe(probe: Any) -> Any:
        def valued(o):
            if isinstance(o, torch.Tensor) and o.device.type == "meta" and not o.is_floating_point():
                return torch.ones(o.shape, dtype=o.dtype, device="cpu")
            return o

        return tree_map(valued, probe)

    @staticmethod
    def device_of(func, args) -> torch.device | None:
        if getattr(func, "__self__", None) is _DEVICE_GETTER and args and args[0].device.type == "meta":
            return torch.device("cpu")
        return None

    @staticmethod
    def rewrite(func, args: tuple, kwargs: dict, moved: Callable[[torch.Tensor, torch.Tensor], None]):
        found: list[torch.Tensor] = []
        tree_map(lambda o: found.append(o) if isinstance(o, torch.Tensor) else None, (args, kwargs))
        if not any(t.device.type == "meta" for t in found):
            return args, kwargs

        def onto_meta(o):
            if isinstance(o, torch.Tensor) and o.device.type == "cpu" and o.dim() > 0:
                m = o.to("meta")
                moved(o, m)
                return m
            return torch.device("meta") if _is_cpu_device(o) else o

        return tree_map(onto_meta, args), tree_map(onto_meta, kwargs)


class _Tracer(TorchFunctionMode):
    def __init__(self, names: dict[int, str], is_leaf: Callable[[nn.Module], bool], meta_as_cpu: bool = False,
                 params: dict[int, str] | None = None):
        super().__init__()
        #: id(parameter or buffer) → its qualified name (first name of a tied one): weights and bias pieces the
        #: forward applies itself through ops
        self.params = params or {}
        self.meta_as_cpu = meta_as_cpu
        self.g = Graph()
        self.names = names
        self.is_leaf = is_leaf
        self._ids: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while tracing
        self._leaf_depth = 0
        self._busy = 0
        self._scope_stack: list[int] = []
        self._leaf_inputs: list[tuple[str, dict[int, list[ArgSlot]], list[int]]] = []

    # -- tensor ids -------------------------------------------------------------------------------
    def _tid(self, t: torch.Tensor, producer: int | None = None, fresh: bool = False) -> int:
        key = id(t)
        if key in self._ids and not fresh:
            return self._ids[key]
        tid = len(self.g.tensors)
        self._ids[key] = tid
        self._alive.append(t)
        name = self.params.get(key) if producer is None else None
        param = name if isinstance(t, nn.Parameter) else None
        self.g.tensors[tid] = TensorInfo(tid, tuple(t.shape), str(t.dtype).replace("torch.", ""), producer, param)
        if name is not None:
            self.g.params.setdefault(tid, name)
        return tid

    def _same_tensor(self, original: torch.Tensor, copy: torch.Tensor) -> None:
        """``copy`` stands for ``original`` in the graph (a CPU tensor moved onto the meta device)."""
        if self._busy or self._leaf_depth:
            return
        self._ids[id(copy)] = self._tid(original)
        self._alive.append(copy)

    def _tensors_in(self, obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        else:
            for _, o in children(obj):
                self._tensors_in(o, out)
        return out

    def _summ(self, obj: Any) -> Any:
        """Compact, value-free description of an op argument."""
        if isinstance(obj, torch.Tensor):
            return ("T", self._tid(obj))
        if isinstance(obj, slice):
            return ("slice", self._summ(obj.start), self._summ(obj.stop), self._summ(obj.step))
        if isinstance(obj, (list, tuple)):
            return tuple(self._summ(o) for o in obj)
        if obj is Ellipsis:
            return "..."
        if isinstance(obj, (int, float, bool, str)) or obj is None:
            return obj
        if isinstance(obj, (torch.dtype, torch.device)):
            return str(obj)
        return f"<{type(obj).__name__}>"

    # -- ops ----------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.meta_as_cpu:
            shown = _MetaAsCpu.device_of(func, args)
            if shown is not None:
                return shown
            args, kwargs = _MetaAsCpu.rewrite(func, args, kwargs, self._same_tensor)
        out = func(*args, **kwargs)
        if self._leaf_depth or self._busy:
            return out
        self._busy += 1
        try:
            self._record_op(func, args, kwargs, out)
        finally:
            self._busy -= 1
        return out

    def _record_op(self, func, args, kwargs, out) -> None:
        try:
            name = resolve_name(func) or getattr(func, "__name__", repr(func))
        except Exception:
            name = getattr(func, "__name__", repr(func))
        ins = [self._tid(t) for t in self._tensors_in((args, kwargs), [])]
        outs_t = self._tensors_in(out, [])
        if not ins and not outs_t:
            return
        idx = len(self.g.nodes)
        short = name.rsplit(".", 1)[-1]
        inplace = short.endswith("_") and not short.endswith("__") or short in _INPLACE_EXCEPTIONS
        info = {"args": self._summ(args), "kwargs": {k: self._summ(v) for k, v in kwargs.items()}}
        outs = [self._tid(t, idx, fresh=True) for t in outs_t] if outs_t else []
        if inplace:
            info["inplace"] = True
        self.g.nodes.append(Node(idx, Callee.OP, name, ins, outs, tuple(self._scope_stack), info))

    # -- modules ------------------------------------------------------------------------------------
    def _slots(self, args, kwargs) -> dict[int, list[ArgSlot]]:
        slots: dict[int, list[ArgSlot]] = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                slots.setdefault(self._tid(a), []).append(ArgSlot(i, None))
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                slots.setdefault(self._tid(v), []).append(ArgSlot(None, k))
        return slots

    def pre_hook(self, module, args, kwargs):
        if self._leaf_depth:
            if self.is_leaf(module):
                self._leaf_depth += 1
            return None
        self._busy += 1
        try:
            name = self.names.get(id(module), "?")
            count = self.g.module_calls.get(name, 0)
            self.g.module_calls[name] = count + 1
            slots = self._slots(args, kwargs)
            if self.is_leaf(module):
                ins = [self._tid(t) for t in self._tensors_in((args, kwargs), [])]
                self._leaf_inputs.append((name, slots, ins))
                self._leaf_depth += 1
            else:
                idx = len(self.g.scopes)
                parent = self._scope_stack[-1] if self._scope_stack else None
                self.g.scopes.append(ScopeCall(idx, name, slots, [], parent, count))
                self._scope_stack.append(idx)
        finally:
            self._busy -= 1
        return None

    def post_hook(self, module, args, kwargs, output):
        if self._leaf_depth > 1 or (self._leaf_depth == 1 and not self.is_leaf(module)):
            if self.is_leaf(module):
                self._leaf_depth -= 1
            return None
        self._busy += 1
        try:
            if self.is_leaf(module):
                self._leaf_depth -= 1
                name, slots, ins = self._leaf_inputs.pop()
                idx = len(self.g.nodes)
                outs = [self._tid(t, idx, fresh=True) for t in self._tensors_in(output, [])]
                info = {"slots": {tid: [(s.position, s.keyword) for s in sl] for tid, sl in slots.items()}}
                self.g.nodes.append(Node(idx, Callee.MODULE, name, ins, outs, tuple(self._scope_stack), info))
            else:
                idx = self._scope_stack.pop()
                self.g.scopes[idx].outputs = [self._tid(t) for t in self._tensors_in(output, [])]
        finally:
            self._busy -= 1
        return None


def _output_paths(obj: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    found: list[tuple[tuple, torch.Tensor]] = []
    for k, v in children(obj):  # ModelOutput is an OrderedDict: its paths are field names
        found += _output_paths(v, path + (k,))
    return found


def call_model(model: nn.Module, probe: Any) -> Any:
    if isinstance(probe, dict):
        return model(**probe)
    if isinstance(probe, (list, tuple)):
        return model(*probe)
    return model(probe)


#: class → does its forward take ``return_dict``? A plain dict, not an lru_cache: the re-apply hook asks on every
#: call, and torch.compile traces a dict lookup as a guarded constant but warns on every lru_cache it meets
_TAKES_RETURN_DICT: dict[type, bool] = {}


def _takes_return_dict(cls: type) -> bool:
    known = _TAKES_RETURN_DICT.get(cls)
    if known is None:
        try:
            params = inspect.signature(cls.forward).parameters.values()
            known = any(p.name == "return_dict" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        except (TypeError, ValueError):
            known = False
        _TAKES_RETURN_DICT[cls] = known
    return known


def wants_tuple(model: nn.Module, kwargs: dict) -> bool:
    """Does this call of a model that can return a ``ModelOutput`` (a config with ``return_dict`` and a
    forward that takes it) ask for a tuple instead (``return_dict=False``, or unset with the config saying so)?"""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "return_dict") or not _takes_return_dict(type(model)):
        return False
    asked = kwargs.get("return_dict")
    return not (getattr(cfg, "return_dict", True) if asked is None else asked)


def _dict_outputs(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: trace a model that returns a ModelOutput in its dict form, so output paths are field
    names (stable whether a later call asks for a dict or a tuple) rather than tuple positions."""
    if wants_tuple(module, kwargs):
        return args, {**kwargs, "return_dict": True}
    return None


def _is_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def trace(model: nn.Module, probe: Any, is_leaf: Callable[[nn.Module], bool]) -> tuple[Graph, Any]:
    """Run ``model`` on ``probe`` once (no grad) and return its data-flow graph and the output (in dict form for
    models that return a ``ModelOutput``)."""
    try:
        return _trace_once(model, probe, is_leaf, meta_as_cpu=False)
    except TraceError as first:
        if not _is_meta(model):
            raise
        try:
            return _trace_once(model, probe, is_leaf, meta_as_cpu=True)
        except TraceError as second:
            if second.module_calls > first.module_calls:  # past the first failure: the cause that remains
                raise
            raise first from first.__cause__


def _trace_once(model: nn.Module, probe: Any, is_leaf: Callable[[nn.Module], bool],
                meta_as_cpu: bool) -> tuple[Graph, Any]:
    names: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), name)
    params: dict[int, str] = {}
    for pname, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        params.setdefault(id(t), pname)
    scripted = {id(m) for m in model.modules() if isinstance(m, torch.jit.ScriptModule)}
    if scripted:  # one opaque node each: TorchScript runs no Python ops the mode could see
        base_leaf = is_leaf
        is_leaf = lambda m: id(m) in scripted or base_leaf(m)  # noqa: E731
    tracer = _Tracer(names, is_leaf, meta_as_cpu, params)
    with ExitStack() as stack:
        if not isinstance(model, torch.jit.ScriptModule):
            stack.callback(model.register_forward_pre_hook(_dict_outputs, with_kwargs=True).remove)
        for mod in model.modules():
            if id(mod) not in scripted:
                stack.callback(mod.register_forward_pre_hook(tracer.pre_hook, with_kwargs=True).remove)
                stack.callback(mod.register_forward_hook(tracer.post_hook, with_kwargs=True).remove)
        if scripted:  # a ScriptModule refuses hooks of its own, but its Python call runs the global ones (which
            # see its positional arguments only: a tensor passed to it by keyword looks unread, so a fold that
            # misses it fails verification and is rolled back)
            from torch.nn.modules import module as nn_module

            stack.callback(nn_module.register_module_forward_pre_hook(
                lambda m, args: tracer.pre_hook(m, args, {}) if id(m) in scripted else None).remove)
            stack.callback(nn_module.register_module_forward_hook(
                lambda m, args, out: tracer.post_hook(m, args, {}, out) if id(m) in scripted else None).remove)
        stack.enter_context(torch.no_grad())
        if meta_as_cpu:
            probe = _MetaAsCpu.probe(probe)
        with tracer:
            try:
                out = call_model(model, probe)
            except OUT_OF_MEMORY:  # the machine's limit, not the probe's: raised as it is
                raise
            except Exception as exc:  # a probe the model cannot take
                err = TraceError(
                    f"the probe forward of {type(model).__name__} failed ({type(exc).__name__}: {exc}); "
                    "pass probe=... (a tensor, a tuple of args or a dict of kwargs the model accepts)"
                )
                err.module_calls = sum(tracer.g.module_calls.values())
                raise err from exc
    g = tracer.g
    for path, t in _output_paths(out):
        tid = tracer._ids.get(id(t))
        if tid is not None:
            g.root_outputs.setdefault(tid, []).append(path)
    g.build_index()
    return g, out
