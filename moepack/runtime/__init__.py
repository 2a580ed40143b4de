"""The runtime (CPU/numba, Metal) lands with the runtime issue; the package exists so the layout is fixed."""
