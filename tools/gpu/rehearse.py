"""Load a GPU check as a module without running its main: its imports and definitions run (CPU rehearsal).

    python tools/gpu/rehearse.py tools/gpu/check_runtime.py
"""

import runpy
import sys

runpy.run_path(sys.argv[1], run_name="rehearsal")
print(f"rehearsed {sys.argv[1]}: imports and definitions load")
