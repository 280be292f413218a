"""The package's closed enumerations, one type each, shared by every layer (match, apply, nn, checkpoint).

Each is a ``str`` enum: a member equals its value (``NormType.RMS == "rms"``), prints as it, and serialises to
JSON as it, so plans and reports written before these types existed read back unchanged. Open sets stay
strings: activation kinds are the ops layer's table (`lmbp_convert.ops.activations`), so a new activation is one
table entry, not an enum edit as well (`GATED_ACT_KINDS` names those the fused gated-MLP op offers). The marker
bases `ConvertedModule`, `ConvertedCallable` and `ConvertedHook` are here too: every layer asks ``isinstance`` of them.
"""
from __future__ import annotations

from enum import Enum

from .deprecation import module_renames


class StrChoice(str, Enum):
    """A str-valued enum that formats as its value on every Python (3.10's ``(str, Enum)`` does not)."""

    def __str__(self) -> str:
        return str(self.value)

    __format__ = str.__format__


class NormType(StrChoice):
    """What a norm normalises by: mean and variance (LayerNorm) or the root mean square (RMSNorm)."""

    LAYER = "layer"
    RMS = "rms"


class WeightParam(StrChoice):
    """How a norm's ``weight`` w gives its scale γ: γ = w (most models) or γ = 1 + w (Gemma-style)."""

    W = "w"
    ONE_PLUS_W = "1+w"

    @property
    def identity(self) -> float:
        """The value of ``weight`` whose scale is 1 (the one table of it: `fold`, the norms and the rewrite read
        it here)."""
        return 1.0 if self is WeightParam.W else 0.0

    @property
    def identity_fill(self) -> str:
        """The memory-sharing norms' ``identity_affine`` spelling of that value: "one" or "zero"."""
        return "one" if self.identity == 1.0 else "zero"


class Layout(StrChoice):
    """How a Linear-like layer stores its weight."""

    OUT_IN = "out_in"  # nn.Linear: (out_features, in_features)
    IN_OUT = "in_out"  # HF Conv1D: (in_features, out_features)


class BetaMode(StrChoice):
    """Where a folded norm's shift β goes."""

    FOLD = "fold"  # into the following Linears' biases
    SHIFT = "shift"  # a target has no bias: β/γ stays the norm's parameter and each target adds W·(β/γ)
    NONE = "none"  # the norm has no β


class ReapplyKind(StrChoice):
    """Where a folded-out affine is put back for a consumer that is not a folded Linear."""

    MODULE_INPUT = "module_input"  # forward pre-hook on the consuming module
    ROOT_OUTPUT = "root_output"  # forward hook on the model, at paths of its output structure


class AffineState(StrChoice):
    """Where a memory-sharing norm's affine lives."""

    FOLDED = "folded"  # in the following Linears; the norm holds no affine (at most identity buffers)
    REAPPLIED = "reapplied"  # the norm keeps γ, β as Parameters; hooks re-apply them on non-Linear branches
    KEPT = "kept"  # the norm applies γ, β itself


class Backend(StrChoice):
    """A launch back end of the ops; `lmbp_convert.ops.backends.TABLE` says which op tries which, in what order."""

    COMPILED = "compiled"  # under torch.compile: the op's torch.library op (a triton_op inductor emits)
    CUDA_HOST = "cuda_host"  # eager CUDA: forward, graph node and backward in C++ (LMBP_CUDA_HOST=1)
    TRITON = "triton"  # eager CUDA: the Triton kernels through LeanKernel's cached launches
    CPU_NATIVE = "cpu_native"  # CPU: the native C++ kernels (csrc/cpu_ops.cpp) through ctypes
    TORCH = "torch"  # the PyTorch reference, on every device


#: The activation kinds the fused gated-MLP op computes (names of the ops layer's activation table). Here, in the
#: leaf every layer reads, so the matcher (which must not import ops) and the op share one list; the ops table
#: checks at import that each has an entry there.
GATED_ACT_KINDS: tuple[str, ...] = ("silu", "gelu", "gelu_tanh")


class ConvertedModule:
    """Marker base of every module this package puts into a model: ``isinstance(m, ConvertedModule)`` says that
    ``m`` is already converted (a class check, not a module-name prefix)."""


class ConvertedCallable:
    """Marker base of the plain callables this package sets as a model's instance attributes (the memory-sharing
    ``loss_function``): matching sees that a model already has one without importing ``nn``."""


class ConvertedHook:
    """Marker base of every hook object this package registers on a model's modules (the affine re-apply and
    shift hooks, the fold-on-load hook): matching tells them from a user's hooks with ``isinstance``. It lives
    here, not next to the hooks in ``apply``, because ``match`` reads it and must not import ``apply``."""


class Verification(StrChoice):
    """What checking the converted model's outputs on the probe found."""

    PASSED = "passed"
    FAILED = "failed"
    CANNOT_VERIFY = "cannot verify"  # the original outputs are non-finite everywhere: nothing to compare
    NOT_RUN = "not run"


# 0.1.0's name of NormType (DeprecationWarning; lmbp_convert.deprecation)
__getattr__ = module_renames(__name__, {"NormKind": ("lmbp_convert.enums.NormType", lambda: NormType)})
