"""``python -m seal.config docs``: regenerate the recipe reference in docs/recipes.md from the schema
(``seal/config/reference.py``); ``--check`` only says whether it is stale (exit 1)."""

from __future__ import annotations

import argparse
import sys

from seal.config import reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seal.config", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    docs = sub.add_parser("docs", help="rewrite the generated part of docs/recipes.md")
    docs.add_argument("--check", action="store_true", help="do not write: exit 1 when the docs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = reference.generated_part() != reference.render()
        print(f"{reference.DOC}: {'stale: run `python -m seal.config docs`' if stale else 'up to date'}")
        return int(stale)
    changed = reference.write()
    print(f"{reference.DOC}: {'regenerated' if changed else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
