import os
import sys

# tests import their small helpers (paged_runner) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))
