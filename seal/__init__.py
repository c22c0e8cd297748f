"""SEAL trainer side: verl extensions (agent loop, A-Patch, capability state, CPU backend)."""
