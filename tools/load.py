"""Load a running `ninfer serve`: the same as `ninfer bench http URL [options]`.

    python tools/load.py http://127.0.0.1:8080 --clients 8 --requests 64

Prints one JSON report: requests/s, TTFT and inter-token p50/p99, completed and 429 counts, and
every incorrect answer (there should be none). Logic: ninfer/server/load.py.
"""

from __future__ import annotations

import sys

from ninfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "http", *sys.argv[1:]]))
