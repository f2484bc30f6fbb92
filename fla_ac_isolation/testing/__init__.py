"""Test support: fault reproductions and shims for running FLA Triton kernels on CPU (never used by library code)."""
