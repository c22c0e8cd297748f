"""tau2-bench's three domains as ``seal.eval`` categories: names and task ids only (no tau2 import, so the
report and the tables read tau2 results without the tau2 environment).

A category ``tau2_<domain>`` is the domain's ``base`` task split (retail 114, airline 50, telecom 114 tasks), the
set the paper's percentages are multiples of. A record's task id is ``tau2_<domain>_<tau2's task id>``.
"""

from __future__ import annotations

TAU2_DOMAINS: tuple[str, ...] = ("retail", "airline", "telecom")
TAU2_CATEGORIES: tuple[str, ...] = tuple(f"tau2_{d}" for d in TAU2_DOMAINS)
TASK_SPLIT = "base"


def tau2_task_id(domain: str, task_id: str) -> str:
    return f"tau2_{domain}_{task_id}"


def split_tau2_task_id(task_id: object) -> tuple[str, str] | None:
    """(domain, tau2's task id) of a record's task id, None for any other id."""
    if not isinstance(task_id, str):
        return None
    for domain in TAU2_DOMAINS:
        if task_id.startswith(f"tau2_{domain}_") and len(task_id) > len(domain) + 6:
            return domain, task_id[len(domain) + 6 :]
    return None
