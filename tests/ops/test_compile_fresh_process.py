"""torch.compile(fullgraph=True) over the ops in a fresh process: no warm caches, so any cache fill or
tensor-to-Python conversion on the traced path shows up as a graph break (an error with fullgraph)."""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # torch.compile in a fresh Python process

SCRIPT = textwrap.dedent("""
    import torch
    from lmbp_convert.ops.approx_act import approx_act
    from lmbp_convert.ops.ms_norm import ms_layer_norm, ms_rms_norm
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
    def block(x):
        h = lin1(ms_layer_norm(x, (16,), 1e-5))
        return lin2(approx_act(h, "gelu", 2)) + lin2(approx_act(h, "silu", 3)) + ms_rms_norm(x, (16,), 1e-6)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 16, dtype=dtype, requires_grad=True)
        lin1.to(dtype), lin2.to(dtype)
        torch._dynamo.reset()
        out = torch.compile(block, fullgraph=True)(x)
        out.float().sum().backward()
    print("ok")
""")


def test_ops_compile_with_fullgraph_in_a_fresh_process():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
