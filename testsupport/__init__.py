"""Fixtures the tests and the benchmarks share, not shipped in the wheel (imported from the checkout root).

    families       tiny random-init models of every family, built from configs
    quant_standin  a packed 4-bit Linear stand-in (bitsandbytes' layout, plain PyTorch)
    bnb            real bitsandbytes 4-bit on CPU where it runs (`cpu_4bit_problem` says why not), `load_4bit`
    blocks         exact saved-for-backward bytes per block (the model cut to fewer blocks)
    triton_stub    the ops' Triton path on a CPU-only machine, every launch a no-op (host-time measurements)
    triton_compile Triton's compile step stubbed on a fake sm_90 driver (`stub_triton_driver`)
    regions        a shared-saves region opened around test code (`open_region`)
    text           a word-level tokenizer and sentences for the trainer tests and the recipes (no download)
"""
