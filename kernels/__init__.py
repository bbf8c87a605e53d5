"""Compute kernels: Triton kernels for CUDA (one per file, each behind a wrapper that
checks its inputs), the compiled CPU kernels (C++ in kernels/cpu/, built, loaded and
wrapped by kernels/cpu_ops.py), and torch references for both (kernels/reference.py).
engine/platform.py chooses which of them run."""
