"""The runtime: load a packed model, stream its experts from disk, generate.

Entry point: `moepack.runtime.model.load_model(packed, backend="numba"|"numpy", io=...)`. Kernels come in
pairs with one signature: `kernels_ref` (numpy, the spec) and `kernels_numba` (the CPU fast path).
"""
