"""``python -m fedra`` and the ``fedra`` command."""

import os
import sys


def main() -> int:
    # gRPC's C core logs at INFO unless told otherwise: a line for each failed TLS
    # handshake, e.g. each retry of a site that dials without TLS, where fedra logs the
    # reason itself. It reads GRPC_VERBOSITY once, when it is imported: so here, before
    # anything imports it. GRPC_VERBOSITY=INFO in the environment brings those lines back.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from fedra.cli import main as cli_main  # noqa: PLC0415  (after the line above)

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
