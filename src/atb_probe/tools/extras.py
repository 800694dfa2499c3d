"""The optional `tools` dependencies (rich, pandas, openpyxl) of the analysis commands.

They are imported only inside the commands that need them, so that `atb-probe where`, `run` and
the probe itself work on an install without the extra; a command that lacks one says how to get it.
"""
from __future__ import annotations

import importlib.util
import sys


def require(command: str, *modules: str) -> bool:
    """True when every module is importable; else print what to install and return False."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return True
    print(f"atb-probe {command}: needs {', '.join(missing)}, which come with the tools extra: "
          "pip install 'atb-probe[tools]'", file=sys.stderr)
    return False
