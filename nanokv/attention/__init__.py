"""Attention backends: one class per implementation, chosen once at start-up.

    common.py       CommonAttentionMetadata: one step as every backend sees it; StepAttention
    backend.py      the AttentionBackend contract
    selector.py     the backends in order of preference, and the choice (`select_backend`)
    torch_paged.py  PyTorch over the float pool (the reference path; CPU and CUDA)
    native_cpu.py   the C decode kernel over a float32 pool on CPU (prefill as torch_paged)
    quantized.py    PyTorch over a quantized store: dequantize the blocks read, then attend
    no_cache.py     causal attention over the step's own K/V (activation profiling)

The kernels they call live next to the tensors they read: `nanokv/layers/attention.py` (paged
attention in PyTorch, the dense reference), `nanokv/layers/native_attention.py` (the C kernel),
`nanokv/quant/attention.py` (attention over a store and its reference).
"""
