"""Reporting: the paper's reproduction as one plan of commands, and its CPU rehearsal (a run's tables and figures are
``seal.results``)."""
