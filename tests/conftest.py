import os
import sys
from pathlib import Path

# tests import their small helpers (paged_runner) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))

# ../shared beside the repository (the session's checkout and CI's clone both have it there)
SHARED = Path(__file__).resolve().parents[2] / "shared"
AUSTEN_DIR = SHARED / "data" / "austen"
