"""From a Hugging Face checkpoint to a verified artifact (see DESIGN.md)."""

from __future__ import annotations

import sys

from kvforge.toolchain.requirements import DependencyError, check_versions

try:
    check_versions()
except DependencyError as _error:
    # The command line (`kvforge`, `python -m kvforge`) imports this package before its own
    # error handling exists: print its one line and exit 2 here. Code that imports kvforge gets the error.
    if sys.argv and (sys.argv[0] == "-m" or sys.argv[0].rsplit("/", 1)[-1] in ("kvforge", "cli.py", "__main__.py")):
        print(f"kvforge: error: {_error}", file=sys.stderr)
        raise SystemExit(2) from None
    raise
