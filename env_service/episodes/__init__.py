"""The service's episodes and their budgets: the registry of every client's episodes, their limits (episodes,
bytes, kept verdicts, run ids), reclaim, and dispatch to the worker processes (``manager``)."""
