"""`python -m hybridpar ...`: the same command line as `hybridpar ...`."""

from hybridpar.cli import entry

if __name__ == "__main__":
    entry()
