"""dsv4.fast: the reference math for production: Triton kernels, torch.compile, CUDA graphs.

Every kernel in `kernels/` is a torch custom op with a fake (meta) implementation, so
`torch.compile(fullgraph=True)` and CUDA-graph capture go through it, and it has a twin in
`dsv4.reference` that a test feeds the same inputs.
"""
