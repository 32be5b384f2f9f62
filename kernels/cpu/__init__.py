"""The CPU engine's C++ kernels and their build."""
