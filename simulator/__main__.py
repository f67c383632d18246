"""`python -m simulator --port 0 ...`: serve until SIGTERM/SIGINT.

Prints one line, `SIMULATOR_READY http://HOST:PORT`, on stdout once it accepts connections;
everything else goes to stderr through logging.
"""

import argparse
import dataclasses
import logging
import signal
import sys
import threading

from simulator.config import SimulatorConfig
from simulator.server import Simulator

logger = logging.getLogger(__name__)

READY_PREFIX = "SIMULATOR_READY"


def build_parser() -> argparse.ArgumentParser:
    defaults = SimulatorConfig()
    parser = argparse.ArgumentParser(prog="python -m simulator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(SimulatorConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        parser.add_argument(flag, dest=f.name, type=_arg_type(f.name, default), default=default,
                            help=f"default: {'(unset)' if f.name == 'api_key' else default}")
    return parser


def _arg_type(name: str, default: object) -> type:
    # Optional fields default to None; their type comes from what they hold when set.
    optional = {"max_queued_requests": int, "api_key": str, "request_log": str,
                "context_length": int}
    if name in optional:
        return optional[name]
    if isinstance(default, bool):
        return _flag
    return type(default)


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = SimulatorConfig(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=config.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sim = Simulator(config).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"{READY_PREFIX} {sim.url}", flush=True)
    while not stop.wait(1.0):
        pass
    logger.info("signal received, stopping")
    sim.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
