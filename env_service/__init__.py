"""BFCL V3 multi-turn environment service: tasks, safe executor, episodes, verifier, HTTP API."""
