"""Evaluate a model on BFCL multi-turn outside training: ``python -m seal.eval`` (see ``__main__``).

Two ways to produce episodes, one results file, one report:

* ``checkpoint``: a checkpoint or hub id through the training run's own validation (``seal.launch`` with
  ``trainer.val_only``), so it scores exactly what its training validation scored; the agent loop writes one
  record per episode (``seal/results/records.py``);
* ``endpoint``: any OpenAI-compatible chat endpoint, text in and text out, against the same environment service;
* ``report``: the per-category table with binomial standard errors, the failure profile, and the same results in
  bfcl-eval's own result-file layout, scored by bfcl's own ``evaluate``.

Out of distribution (``endpoint`` only, never trained on): bfcl V4's memory and web search (``ood.py``) and
tau2-bench's retail, airline and telecom with tau2's own environments, user simulator and evaluator (``tau2.py``).
"""
