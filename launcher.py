"""Train a SEAL recipe: ``python launcher.py --conf exp/SEAL.yaml [hydra overrides]`` (see seal/launch/)."""

import sys

from seal.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
