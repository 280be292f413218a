"""The ops' launch back ends, in one folder: `dispatch` (the table of which op tries which back end, in what
order), `build` (the one build/load helper of the back ends compiled on the user's machine), `cpu_native` (the
native CPU kernels' ctypes entry points), `cuda_host` (the C++ CUDA host launcher: its state, kernel slots and
launch-miss callback), `compiled` (the compile registration), ``csrc/`` (their C++ sources).
"""
