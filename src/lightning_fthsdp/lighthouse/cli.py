"""``fthsdp lighthouse``: run the quorum service until SIGTERM or SIGINT (then exit 0).

Prints exactly one line to stdout once both ports are bound, which launchers and tests parse:
``fthsdp lighthouse listening on http://HOST:PORT store HOST:STOREPORT``. Invalid arguments exit 2 with a
message naming the value; a port already in use exits 1 with the OSError.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from lightning_fthsdp.config.env import ENV_TOKEN, from_env
from lightning_fthsdp.config.timeouts import Timeouts
from lightning_fthsdp.lighthouse.quorum import QuorumRules, check_replica_id


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    defaults = Timeouts()
    parser = subparsers.add_parser(
        "lighthouse",
        help="run the quorum service (control plane) and rendezvous store",
        description="Run the lighthouse: quorum decisions, failure detection and the cross-group rendezvous store.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=29510, help="HTTP port; 0 picks a free one (default 29510)")
    parser.add_argument("--store-port", type=_port, default=0,
                        help="TCPStore port for cross-group process groups; 0 picks a free one (default 0)")
    parser.add_argument("--min-replicas", type=_positive, default=1,
                        help="fewest replica groups a quorum may have (default 1)")
    parser.add_argument("--join-timeout-ms", type=_positive, default=defaults.join_timeout_ms,
                        help=f"wait this long for heartbeating stragglers before answering without them "
                             f"(default {defaults.join_timeout_ms})")
    parser.add_argument("--heartbeat-timeout-ms", type=_positive, default=defaults.heartbeat_timeout_ms,
                        help=f"a replica group silent this long is declared dead (default "
                             f"{defaults.heartbeat_timeout_ms})")
    parser.add_argument("--replica-ids", type=_replica_ids, default=None,
                        help="the job's replica ids, comma-separated: any other id is refused, and a group that only "
                             "heartbeats still counts towards the majority (default: admit any id)")
    parser.add_argument("--lost-state-wait-ms", type=_positive, default=int(QuorumRules.lost_state_wait_s * 1000),
                        help="when no live group holds the committed step, wait this long for one before restarting "
                             "from an older step and reporting the steps lost (default %(default)s)")
    parser.add_argument("--token", default=None,
                        help=f"require 'Authorization: Bearer TOKEN' on every request (default: ${ENV_TOKEN}; "
                             f"the argument wins)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lightning_fthsdp.lighthouse.server import Lighthouse

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lighthouse = Lighthouse(
        host=args.host,
        port=args.port,
        store_port=args.store_port,
        rules=QuorumRules(min_replicas=args.min_replicas, join_timeout_s=args.join_timeout_ms / 1000,
                          lost_state_wait_s=args.lost_state_wait_ms / 1000),
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        replica_ids=args.replica_ids,
        token=from_env(args.token, ENV_TOKEN),
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await lighthouse.start()
        # GC tuning for a burst of requests from every group at once (bench/bench_lighthouse.py measures it): freeze
        # the import-time objects (torch's, for the TCPStore, are most of them) out of full collections, and collect
        # the young generation less often so in-flight requests are not promoted and rescanned.
        gc.freeze()
        gc.set_threshold(100_000, 20, 100)
        print(f"fthsdp lighthouse listening on {lighthouse.url} store {lighthouse.store_address}", flush=True)
        try:
            await stop.wait()
        finally:
            await lighthouse.stop()

    try:
        asyncio.run(main())
    except OSError as e:
        print(f"fthsdp lighthouse: cannot bind {args.host}:{args.port} or store port {args.store_port}: {e}",
              file=sys.stderr)
        return 1
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _replica_ids(text: str) -> list[str]:
    ids = text.split(",")
    try:
        return [check_replica_id(rid) for rid in ids]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (in --replica-ids {text!r}: comma-separated ids)") from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535 (0: any free port), got {value}")
    return value
