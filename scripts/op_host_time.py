"""Host time per op call (fwd+bwd) of the Triton launch path vs the native op it replaces, on CPU.

The GPU is replaced by a stub at Triton's level (an active driver reporting device 0 / stream 0 / sm_90, and a
compile step returning a kernel whose launch does nothing), so every other host cost of a launch runs as in
production: Triton's binder on the first call, our launch cache, autograd, allocation. Tiny tensors, so the
figures are host time. Interleaved A/B rounds in one process, 1 thread, ``time.thread_time``, medians.

    python scripts/op_host_time.py [--rounds 30] [--calls 200]

Self-contained (no import of lmbp_convert's own stub), so it measures older revisions too.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


@contextlib.contextmanager
def stubbed_gpu():
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Compiled:
        function, packed_metadata = 0, None

        def launch_metadata(self, *a):
            return None

        def run(self, *a):
            return None

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        k = Compiled()
        self.device_caches[device][0][key] = k
        return k

    old = JITFunction._do_compile, driver._active
    JITFunction._do_compile = do_compile
    driver.set_active(Driver())
    try:
        yield
    finally:
        JITFunction._do_compile, driver._active = old


def cases(d: int = 64, rows: int = 8):
    from lmbp_convert.ops import approx_act as A
    from lmbp_convert.ops import gated_mlp as G
    from lmbp_convert.ops import ms_norm as N

    tri = lambda t: t.dtype in (torch.float32, torch.float16, torch.bfloat16)  # noqa: E731
    N.use_triton = tri
    G.use_triton = lambda t: True
    x = torch.randn(rows, d, requires_grad=True)
    u = torch.randn(rows, d, requires_grad=True)
    gy = torch.randn(rows, d)
    w, b = torch.ones(d), torch.zeros(d)
    act_mod = None
    try:
        from lmbp_convert.nn.activations import ApproxActivation
        act_mod = ApproxActivation("silu", 2)
    except Exception:
        pass

    def step(fn):
        def run():
            fn().backward(gy)
        return run

    out = {
        "approx_act silu": (step(lambda: A.approx_act(x, "silu", 2, backend="triton")), step(lambda: F.silu(x))),
        "ms_layer_norm": (step(lambda: N.ms_layer_norm(x, (d,), 1e-5)), step(lambda: F.layer_norm(x, (d,), w, b))),
        "ms_rms_norm": (step(lambda: N.ms_rms_norm(x, (d,), 1e-6)), step(lambda: F.rms_norm(x, (d,), w, 1e-6))),
        "gated_act silu": (step(lambda: G.gated_act(x, u, "silu")), step(lambda: F.silu(x) * u)),
    }
    try:
        from lmbp_convert.nn.norms import MSLayerNorm
        ms_ln, ln = MSLayerNorm(d), torch.nn.LayerNorm(d)
        out["MSLayerNorm module"] = (step(lambda: ms_ln(x)), step(lambda: ln(x)))
    except Exception:
        pass
    if act_mod is not None:
        torch_mod = torch.nn.SiLU()
        if hasattr(A, "approx_act_unchecked"):  # the module's own entry point, routed to the Triton path
            out["ApproxActivation module"] = (step(lambda: A.approx_act_unchecked(x, "silu", 2, "triton")),
                                              step(lambda: torch_mod(x)))
    return out


def measure(a, b, rounds: int, calls: int) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(rounds):
        for fn, acc in ((a, ta), (b, tb)):
            t0 = time.thread_time()
            for _ in range(calls):
                fn()
            acc.append((time.thread_time() - t0) / calls * 1e6)
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with stubbed_gpu():
        print(f"{'op':26s} {'ours µs':>9s} {'native µs':>10s} {'extra µs':>9s}")
        for name, (ours, native) in cases().items():
            for _ in range(20):  # compile (stub) + warm caches
                ours(), native()
            o, n = measure(ours, native, args.rounds, args.calls)
            print(f"{name:26s} {o:9.1f} {n:10.1f} {o - n:9.1f}")


if __name__ == "__main__":
    main()
