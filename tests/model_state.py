"""Snapshot everything a user can observe on a model, and assert a model is exactly as snapshotted."""
from __future__ import annotations

import torch
from torch import nn

HOOK_ATTRS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
              "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def snapshot(model: nn.Module) -> dict:
    """Everything a user can observe: values, module and Parameter objects, flags, hooks, attributes."""
    return {
        "values": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "modules": [(n, m, type(m)) for n, m in model.named_modules(remove_duplicate=False)],
        "params": [(n, p, p.requires_grad, p.data.data_ptr()) for n, p in
                   model.named_parameters(remove_duplicate=False)],
        "buffers": [(n, b) for n, b in model.named_buffers(remove_duplicate=False)],
        "slots": [(n, list(m._parameters), list(m._buffers), sorted(k for k in vars(m) if not k.startswith("_")))
                  for n, m in model.named_modules(remove_duplicate=False)],
        "training": [(n, m.training) for n, m in model.named_modules(remove_duplicate=False)],
        "hooks": [(n, a, list(getattr(m, a).items())) for n, m in model.named_modules(remove_duplicate=False)
                  for a in HOOK_ATTRS],
        "report": model.__dict__.get("lmbp_report", "absent"),
        "config": model.config.to_dict() if hasattr(getattr(model, "config", None), "to_dict") else None,
        "grad_enabled": torch.is_grad_enabled(),
        "default_device": torch.get_default_device(),
    }


def assert_same(model: nn.Module, before: dict, what: str) -> None:
    now = snapshot(model)
    assert [(n, type(m)) for n, m, _ in now["modules"]] == [(n, t) for n, _, t in before["modules"]], what
    assert all(a is b for (_, a, _), (_, b, _) in zip(now["modules"], before["modules"])), what
    assert [(n, rg, ptr) for n, _, rg, ptr in now["params"]] == [(n, rg, ptr) for n, _, rg, ptr in before["params"]], what
    assert all(a is b for (_, a, *_), (_, b, *_) in zip(now["params"], before["params"])), what
    assert [n for n, _ in now["buffers"]] == [n for n, _ in before["buffers"]], what
    assert all(a is b for (_, a), (_, b) in zip(now["buffers"], before["buffers"])), what
    assert now["values"].keys() == before["values"].keys(), what
    for k, v in before["values"].items():
        assert torch.equal(now["values"][k], v), f"{what}: {k} changed"
    assert now["slots"] == before["slots"], what  # e.g. a `bias=None` parameter slot stays a parameter slot
    assert now["training"] == before["training"], what
    assert [(n, a, [(i, id(h)) for i, h in hs]) for n, a, hs in now["hooks"]] == \
           [(n, a, [(i, id(h)) for i, h in hs]) for n, a, hs in before["hooks"]], what
    assert now["report"] is before["report"], what
    assert now["config"] == before["config"], what
    assert (now["grad_enabled"], now["default_device"]) == (before["grad_enabled"], before["default_device"]), what
