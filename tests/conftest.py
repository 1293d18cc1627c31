"""Shared test setup: the repository root on sys.path, so tests import the top-level modules as `import grpo`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
