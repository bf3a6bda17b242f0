"""``python -m kvledger.runtime.native build | status``: compile the CPU kernels or say whether they load."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvledger.runtime.native", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["build", "status"])
    ap.add_argument("--verbose", action="store_true", help="show the compiler's command lines")
    args = ap.parse_args(argv)
    from . import build, status

    if args.command == "build":
        t = time.perf_counter()
        print("kvledger: building the native CPU kernels (once per machine and torch version) ...", flush=True)
        try:
            path = build(verbose=args.verbose)
        except Exception as exc:  # noqa: BLE001 -- one clear line; the runtime falls back to torch
            first = str(exc).strip().splitlines()
            print(f"kvledger: error: native build failed: {first[-1] if first else type(exc).__name__} "
                  "(KVLEDGER_NATIVE=0 skips it; the runtime then uses its pure-torch paths)", file=sys.stderr)
            return 2
        print(f"kvledger: native kernels ready in {time.perf_counter() - t:.0f} s: {path}")
    print(f"kvledger: native kernels: {status()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
