"""`python -m tests.chaos.probe PORT`: GET /healthz every 100 ms, one JSON line per probe.

The health probe of the chaos and hostile runs, in a process of its own: a
probe inside the process that also runs the load would time that process's
own event loop as well as the edge. Each line is `{"ms": round trip}` for a
200 (a fresh connection, timed to the end of the answer; a probe past the
limit is timed at the limit, so a frozen edge shows), or `{"error": what}`
for anything else. Runs until killed.
"""

from __future__ import annotations

import json
import socket
import sys
import time

EVERY_S = 0.1
LIMIT_S = 10.0
HEALTHZ_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: chaos\r\nConnection: close\r\n\r\n"


def probe(port: int) -> dict[str, float | str]:
    start = time.monotonic()
    answer = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=LIMIT_S) as sock:
            sock.sendall(HEALTHZ_REQUEST)
            while data := sock.recv(4096):
                answer += data
    except TimeoutError:
        return {"ms": LIMIT_S * 1000}
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not answer.startswith(b"HTTP/1.1 200"):
        return {"error": f"answer {answer[:40]!r}"}
    return {"ms": (time.monotonic() - start) * 1000}


def main() -> None:
    port = int(sys.argv[1])
    while True:
        print(json.dumps(probe(port)), flush=True)
        time.sleep(EVERY_S)


if __name__ == "__main__":
    main()
