"""Reporting: the paper's numbers, the reproduction plan and its rehearsal, and the figures of a run."""
