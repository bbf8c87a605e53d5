"""Compute kernels: Triton kernels for CUDA, each paired with a torch reference in
kernels/reference.py (which the CPU path runs)."""
