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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=16032)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tiny", action="store_true", help="T 64, V 300, d 32, 3 repeats")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.tiny:
        a.tokens, a.vocab, a.hidden, a.repeats = 64, 300, 32, 3
    t0 = time.perf_counter()
    C.quiet()
    data = run(a.tokens, a.vocab, a.hidden, a.repeats, a.json)
    print()
    print(table(data))
    C.finish(data, t0, a.json)
    return C.print_end(data)


if __name__ == "__main__":
    raise SystemExit(main())
