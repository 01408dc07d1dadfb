"""DDTree engine and benchmark runner: the payload shipped to GPU hosts (torch, triton, numpy, pyarrow only)."""
