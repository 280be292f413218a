"""Memory-saving ops. Each file holds one op family: Triton kernel, launcher, autograd.Function and the
PyTorch path (the reference on every non-CUDA device)."""
