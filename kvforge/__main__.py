"""`python -m kvforge`: the command line, as the `kvforge` script runs it."""

from kvforge.cli import run

if __name__ == "__main__":
    run()
