"""The LM-head loss on CPU: HF's ``ForCausalLMLoss`` against the memory-sharing loss (`lmbp_convert.nn.loss`).

    python -m benchmarks.loss                    # vocab 16032, T 2048, d 512, bf16 and fp32 (issue 19's shape)
    python -m benchmarks.loss --tiny             # smoke size
    python -m benchmarks.loss --json build/loss.json --repeats 9

Per dtype and set-up — ``loss`` (the loss on logits that exist already), ``head`` (a bias-free Linear d → V, then
the loss), ``head+softcap`` (Gemma-2's ``tanh(z / c) · c`` between them) — three figures for each loss:

- saved-for-backward bytes of the forward (`SavedTensorLedger`, exact: unique storages, parameters excluded);
- the peak of live tensors across forward + backward (torch's ``MemTracker``: every tensor the step allocates,
  gradients included; for ``loss`` the logits were allocated before the step, so they are not in it, for both);
- the step time (forward + backward), interleaved A/B, one thread, ``time.thread_time``, medians; the ratio is
  memory-sharing / HF.

The loss values and logits gradients are compared too (max relative error of the loss, max abs error of the
gradient in units of its dtype's eps × its largest element).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks import common as C

SETUPS = ("loss", "head", "head+softcap")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SOFTCAP = 30.0  # Gemma-2's final_logit_softcapping


def _losses(vocab: int):
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lmbp_convert.nn.loss import MSCrossEntropyLoss

    ours = MSCrossEntropyLoss(True)
    return {"hf": lambda z, y: ForCausalLMLoss(z, y, vocab), "ms": lambda z, y: ours(z, y, vocab)}


class Case:
    """The tensors of one (dtype, set-up) row; ``forward(loss_fn)`` runs it, ``grads()`` reads and clears."""

    def __init__(self, setup: str, dtype: torch.dtype, tokens: int, vocab: int, hidden: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.setup = setup
        self.labels = torch.randint(0, vocab, (1, tokens), generator=gen)
        self.labels[0, : tokens // 16] = -100  # a prompt whose tokens are not trained on
        if setup == "loss":
            self.leaves = [(torch.randn(1, tokens, vocab, generator=gen) * 2).to(dtype).requires_grad_()]
        else:
            h = torch.randn(1, tokens, hidden, generator=gen).to(dtype).requires_grad_()
            w = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5).to(dtype).requires_grad_()
            self.leaves = [h, w]

    def logits(self) -> torch.Tensor:
        if self.setup == "loss":
            return self.leaves[0]
        z = F.linear(self.leaves[0], self.leaves[1])
        return torch.tanh(z / SOFTCAP) * SOFTCAP if self.setup == "head+softcap" else z

    def step(self, loss_fn) -> torch.Tensor:
        loss = loss_fn(self.logits(), self.labels)
        loss.backward()
        return loss.detach()

    def grads(self) -> list[torch.Tensor]:
        out = [t.grad for t in self.leaves]
        for t in self.leaves:
            t.grad = None
        return out


def saved_bytes(case: Case, loss_fn) -> int:
    from lmbp_convert.memory import SavedTensorLedger

    with SavedTensorLedger(case.leaves[1:]) as ledger:  # the head's weight is a parameter, not an activation
        loss_fn(case.logits(), case.labels)
    return ledger.bytes


def peak_bytes(case: Case, loss_fn) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    C.free()
    tracker = MemTracker()
    with tracker:
        case.step(loss_fn)
    case.grads()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def compare(case: Case, fns: dict) -> dict:
    """The memory-sharing loss and its first leaf's gradient (the logits, or the hidden states behind the head)
    against HF's."""
    (l0, g0), (l1, g1) = [(case.step(fns[k]), case.grads()[0]) for k in ("hf", "ms")]
    eps = torch.finfo(g0.dtype).eps
    return {"loss_hf": float(l0), "loss_ms": float(l1), "loss_rel_err": abs(float(l1) / float(l0) - 1),
            "grad_err_eps": float((g1.double() - g0.double()).abs().max() / (eps * g0.double().abs().max()))}


def run(tokens: int, vocab: int, hidden: int, repeats: int, json_path: str | None) -> dict:
    torch.set_num_threads(1)
    fns = _losses(vocab)
    data = {"machine": C.machine(), "tokens": tokens, "vocab": vocab, "hidden": hidden, "repeats": repeats,
            "rows": []}
    for dname, dtype in DTYPES.items():
        for setup in SETUPS:
            case = Case(setup, dtype, tokens, vocab, hidden)
            row = {"dtype": dname, "setup": setup}
            row.update({f"saved_{k}": saved_bytes(case, fn) for k, fn in fns.items()})
            row.update({f"peak_{k}": peak_bytes(case, fn) for k, fn in fns.items()})
            row.update(compare(case, fns))
            steps = {k: (lambda fn=fn: (case.step(fn), case.grads())) for k, fn in fns.items()}
            times = C.time_interleaved(steps, repeats, warmup=1, clock=time.thread_time)
            row.update({f"time_{k}_s": C.median(v) for k, v in times.items()})
            row["time_ratio"] = row["time_ms_s"] / row["time_hf_s"]
            data["rows"].append(row)
            print(_line(row), flush=True)
            C.save_json(json_path, data)
    return data


def llama(tokens: int, vocab: int, hidden: int, layers: int):
    """Issue 19's LLaMA-3-8B shape scaled 8× in width (d 512, FFN 1792, 8 heads, 2 KV heads), ``layers`` layers,
    bf16, SDPA, gradient checkpointing on (where the loss holds the peak), labels = input_ids."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                               num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                               num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=max(tokens, 64),
                               tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def model_rows(tokens: int, vocab: int, hidden: int, layers: int, repeats: int) -> dict:
    """The whole forward + backward of the checkpointed model: HF's loss against convert(loss only)."""
    import copy

    from lmbp_convert import convert

    base, kw = llama(tokens, vocab, hidden, layers)
    ours = copy.deepcopy(base)
    convert(ours, activations=False, norms=False, gated_mlp=False)
    models = {"hf": base, "ms": ours}

    def step(m):
        loss = m(**kw).loss
        loss.backward()
        m.zero_grad(set_to_none=True)
        return loss.detach()

    row = {"setup": f"llama {layers}L + ckpt", "dtype": "bf16"}
    from torch.distributed._tools.mem_tracker import MemTracker

    for k, m in models.items():
        C.free()
        tracker = MemTracker()
        tracker.track_external(m)
        with tracker:
            row[f"loss_{k}"] = float(step(m))
        snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        row[f"peak_{k}"] = int(snap["Total"])
        by = {getattr(key, "value", key): int(v) for key, v in snap.items()}
        row[f"peak_{k}_parts"] = {n: by.get(n, 0) for n in ("Parameter", "Gradient", "Activation", "Temp")}
    times = C.time_interleaved({k: (lambda m=m: step(m)) for k, m in models.items()}, repeats, warmup=1,
                               clock=time.thread_time)
    row.update({f"time_{k}_s": C.median(v) for k, v in times.items()})
    row["time_ratio"] = row["time_ms_s"] / row["time_hf_s"]
    row["loss_rel_err"] = abs(row["loss_ms"] / row["loss_hf"] - 1)
    return row


def _line(r: dict) -> str:
    return (f"{r['dtype']:5} {r['setup']:13} saved {C.mib(r['saved_hf'])} → {C.mib(r['saved_ms'])} "
            f"MiB, peak {C.mib(r['peak_hf'])} → {C.mib(r['peak_ms'])} MiB, "
            f"time {r['time_ratio']:.2f}×, loss rel err {r['loss_rel_err']:.1e}, grad err {r['grad_err_eps']:.2f} eps")


def table(data: dict) -> str:
    rows = []
    for r in data["rows"]:
        rows.append([r["dtype"], r["setup"], f"{r['saved_hf']:,}", f"{r['saved_ms']:,}",
                     C.pct(r["saved_ms"], r["saved_hf"]), C.mib(r["peak_hf"]), C.mib(r["peak_ms"]),
                     C.pct(r["peak_ms"], r["peak_hf"]), f"{r['time_ratio']:.2f}×", f"{r['loss_rel_err']:.1e}",
                     f"{r['grad_err_eps']:.2f}"])
    return C.markdown_table(["logits", "set-up", "saved B, HF", "saved B, ours", "Δ", "peak MiB, HF", "peak MiB, ours",
                             "Δ", "time ours/HF", "loss rel. err", "grad err (eps·max)"], rows)


def model_table(r: dict) -> str:
    return C.markdown_table(
        ["model", "peak MiB, HF loss", "peak MiB, MS loss", "Δ", "at the peak: params / grads / acts / temps MiB, HF",
         "same, MS", "time MS/HF", "loss rel. err"],
        [[r["setup"], C.mib(r["peak_hf"]), C.mib(r["peak_ms"]), C.pct(r["peak_ms"], r["peak_hf"]),
          " / ".join(C.mib(v) for v in r["peak_hf_parts"].values()),
          " / ".join(C.mib(v) for v in r["peak_ms_parts"].values()), f"{r['time_ratio']:.2f}×",
          f"{r['loss_rel_err']:.1e}"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=16032)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tiny", action="store_true", help="T 64, V 300, d 32, 3 repeats")
    p.add_argument("--layers", type=int, default=2, help="layers of the checkpointed LLaMA (0: leave it out)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.tiny:
        a.tokens, a.vocab, a.hidden, a.repeats = 64, 300, 32, 3
    t0 = time.perf_counter()
    C.quiet()
    data = run(a.tokens, a.vocab, a.hidden, a.repeats, a.json)
    if a.layers:
        torch.set_num_threads(1)
        data["model"] = model_rows(a.tokens, a.vocab, a.hidden, a.layers, max(3, a.repeats // 2))
        C.save_json(a.json, data)
    print()
    print(table(data))
    if "model" in data:
        print()
        print(model_table(data["model"]))
    C.finish(data, t0, a.json)
    return C.print_end(data)


if __name__ == "__main__":
    raise SystemExit(main())
