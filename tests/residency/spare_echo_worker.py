"""A stand-in worker module for spare-pool tests: no PyTorch. `warm_up` sleeps
SPARE_ECHO_WARM_S seconds; `main(argv)` writes its arguments to SPARE_ECHO_OUT and exits 0, once
the file SPARE_ECHO_HOLD exists where that is set (a worker running until the test lets it go)."""

from __future__ import annotations

import json
import os
import time


def warm_up() -> None:
    time.sleep(float(os.environ.get("SPARE_ECHO_WARM_S", "0")))


def main(argv: list[str]) -> int:
    with open(os.environ["SPARE_ECHO_OUT"], "w") as out:
        json.dump({"argv": argv, "pid": os.getpid()}, out)
    hold = os.environ.get("SPARE_ECHO_HOLD")
    while hold and not os.path.exists(hold):
        time.sleep(0.02)
    return 0
