"""Entry point: ``python -m tandem_operator [kopf run options]``, e.g.
``python -m tandem_operator --namespace tandem``. Runs kopf with
:mod:`tandem_operator.handlers`, standalone (one replica, no peering)."""

from __future__ import annotations

import sys

from kopf.cli import main as kopf_main


def main() -> None:
    sys.argv = ["kopf", "run", "--standalone", "--module", "tandem_operator.handlers", *sys.argv[1:]]
    kopf_main()


if __name__ == "__main__":
    main()
