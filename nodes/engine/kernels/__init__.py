"""Matmul kernels of our own for CPUs where torch's are slow, compiled on the machine at first use (build.py)."""
