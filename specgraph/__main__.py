"""``python -m specgraph``: the ``specgraph`` command (for machines where it is not installed)."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
