"""Triton kernels and their PyTorch references (payload)."""
