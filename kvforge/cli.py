"""The `kvforge` command: the runtime's commands (`kvforge.runners.cli`) with the build
commands (`kvforge.toolchain.cli`), which load only when one of them runs or the help lists
them, so that `kvforge generate` and `kvforge serve` never import the build side."""

from __future__ import annotations

from kvforge.runners.cli import main, run

BUILD_COMMANDS = ("build", "build-engine", "export-triton", "inspect", "verify")
main.add_elsewhere("kvforge.toolchain.cli", BUILD_COMMANDS)

__all__ = ["main", "run"]

if __name__ == "__main__":
    run()
