"""``fthsdp lighthouse``: run the quorum service until SIGTERM or SIGINT (then exit 0).

Prints exactly one line to stdout once both ports are bound, which launchers and tests parse:
``fthsdp lighthouse listening on http://HOST:PORT store HOST:STOREPORT``. Invalid arguments exit 2 with a
message naming the value; a host that does not resolve or is not this machine's, or a port already in use, exits 1
at once with one line naming it.

The token comes from ``$FTHSDP_TOKEN`` or ``--token-file``, never from an argument (``ps`` shows arguments to every
user), and is never printed. Without one the lighthouse listens only on a loopback address unless ``--insecure``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import logging
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from lightning_fthsdp.config.env import ENV_TOKEN, from_env
from lightning_fthsdp.config.timeouts import Timeouts, field_docs
from lightning_fthsdp.lighthouse import lanes
from lightning_fthsdp.lighthouse.quorum import QuorumRules
from lightning_fthsdp.lighthouse.stragglers import MODES, StragglerPolicy
from lightning_fthsdp.protocol.quorum import check_replica_id


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
    parser.add_argument("--shard-count", type=_positive, default=None,
                        help="the job's shard ranks per replica group: a group with another count is refused (default: "
                             "the live groups' count, as the first of them to ask sets it)")
    parser.add_argument("--lost-state-wait-ms", type=_non_negative, default=QuorumRules.lost_state_wait_ms,
                        help="when no live group holds the committed step, wait this long for one before restarting "
                             "from an older step and reporting the steps lost (default %(default)s)")
    # Help from StragglerPolicy's field docstrings: one source for --help, the recipe keys and the docs.
    straggler_docs, straggler_defaults = field_docs(StragglerPolicy), StragglerPolicy()
    parser.add_argument("--straggler-policy", choices=MODES, default=straggler_defaults.mode,
                        help=f"{straggler_docs['mode']} (default %(default)s)")
    parser.add_argument("--straggler-factor", type=float, default=straggler_defaults.factor,
                        help=f"{straggler_docs['factor']} (default %(default)s)")
    parser.add_argument("--straggler-window", type=int, default=straggler_defaults.window,
                        help=f"{straggler_docs['window']} (default %(default)s)")
    parser.add_argument("--token-file", type=Path, default=None, metavar="PATH",
                        help=f"read the job's token from this file (default: ${ENV_TOKEN}); every request then "
                             f"needs 'Authorization: Bearer TOKEN', and the groups need the same token")
    parser.add_argument("--insecure", action="store_true",
                        help="listen on a non-loopback --host without a token: anyone who reaches it can join, "
                             "stall or end the job")
    parser.add_argument("--event-loop", choices=EVENT_LOOPS, default="asyncio",
                        help="the event loop serving the groups: asyncio (the standard library's, on a selector that "
                             "reads new connections first however far behind the groups are), uvloop (libuv's, "
                             "pip install 'lightning-fthsdp[uvloop]'), or auto: uvloop where installed (default "
                             "%(default)s; bench/bench_lighthouse.py compares them)")
    # Refused in run() with the fix: a token on the command line is visible to every user through ps.
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lightning_fthsdp.lighthouse.server import Lighthouse

    try:
        loop_factory = event_loop_factory(args.event_loop)
    except ImportError as e:
        return _fail(2, f"--event-loop uvloop: {e}; pip install 'lightning-fthsdp[uvloop]', or --event-loop asyncio")

    if args.replica_ids is not None and args.min_replicas > len(args.replica_ids):
        return _fail(2, f"--min-replicas {args.min_replicas} exceeds the {len(args.replica_ids)} groups of "
                        f"--replica-ids {','.join(args.replica_ids)}: no quorum could ever form; lower --min-replicas "
                        f"or declare every group's id")
    if args.token is not None:
        return _fail(2, f"--token is not accepted (every user can read command lines with ps): set ${ENV_TOKEN} or "
                        f"pass --token-file PATH")
    try:
        token = _read_token(args.token_file) if args.token_file is not None else from_env(None, ENV_TOKEN)
        if token is not None:
            _check_token(token, f"--token-file {str(args.token_file)!r}" if args.token_file else f"${ENV_TOKEN}")
    except ValueError as e:
        return _fail(2, str(e))
    try:
        stragglers = StragglerPolicy(args.straggler_policy, args.straggler_factor, args.straggler_window)
    except ValueError as e:
        return _fail(2, f"{e} (--straggler-policy, --straggler-factor, --straggler-window)")
    try:
        loopback = _is_loopback(args.host)
    except OSError as e:
        return _fail(1, f"cannot resolve --host {args.host!r} ({e}): give a name or address of this machine")
    if not (token or loopback or args.insecure):
        return _fail(2, f"refusing to listen on --host {args.host}, which is not a loopback address, without a "
                        f"token: set ${ENV_TOKEN} or pass --token-file PATH (or --insecure to let anyone who reaches "
                        f"it join the job)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lighthouse = Lighthouse(
        host=args.host,
        port=args.port,
        store_port=args.store_port,
        rules=QuorumRules(min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                          lost_state_wait_ms=args.lost_state_wait_ms),
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        replica_ids=args.replica_ids,
        token=token,
        straggler_policy=stragglers,
        shard_count=args.shard_count,
    )

    async def main() -> None:
        stop = asyncio.Event()
        await lighthouse.start()  # raises the open-files limit, and logs it
        # Only now: until here SIGTERM keeps its default action and ends the process wherever startup is.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # GC tuning for a burst of requests from every group at once (bench/bench_lighthouse.py measures it): freeze
        # the import-time objects (torch's, for the TCPStore, are most of them) out of full collections, and collect
        # the young generation less often so in-flight requests are not promoted and rescanned.
        gc.freeze()
        gc.set_threshold(100_000, 20, 100)
        logging.getLogger("fthsdp.lighthouse").info("event loop: %s", type(loop).__module__.split(".")[0])
        print(f"fthsdp lighthouse listening on {lighthouse.url} store {lighthouse.store_address}", flush=True)
        try:
            await stop.wait()
        finally:
            await lighthouse.stop()

    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main())
    except OSError as e:
        return _fail(1, f"cannot listen on --host {args.host} (port {args.port}, store port {args.store_port}): {e}; "
                        f"give an address of this machine (0.0.0.0: all of them) and free ports")
    return 0


EVENT_LOOPS = ("asyncio", "uvloop", "auto")


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The factory of the event loop ``choice`` names: asyncio's on the lighthouse's two-lane selector
    (``lighthouse.lanes``), or uvloop's. ``auto`` takes uvloop where it is installed; ``uvloop`` raises ImportError
    where it is not."""
    if choice == "asyncio":
        return lanes.new_event_loop
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return lanes.new_event_loop
    return uvloop.new_event_loop


def _fail(code: int, message: str) -> int:
    print(f"fthsdp lighthouse: {message}", file=sys.stderr)
    return code


def _read_token(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace, e.g. the final newline, dropped); never echoed in errors."""
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --token-file {str(path)!r}: {e}") from None
    if not token:
        raise ValueError(f"--token-file {str(path)!r} is empty: write the job's token into it")
    return token


def _check_token(token: str, source: str) -> None:
    """A ValueError naming ``source`` (never the token) unless ``token`` can travel in an HTTP header."""
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ValueError(f"the token in {source} holds characters an HTTP header cannot carry: use printable ASCII "
                         f"without spaces, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'")


def _is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (socket.gaierror if it does not resolve)."""
    addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    return all(ipaddress.ip_address(address.partition("%")[0]).is_loopback for address in addresses)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive, _non_negative = _at_least(1), _at_least(0)


def _replica_ids(text: str) -> list[str]:
    ids = text.split(",")
    try:
        checked = [check_replica_id(rid) for rid in ids]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (in --replica-ids {text!r}: comma-separated ids)") from None
    repeated = sorted({rid for rid in checked if checked.count(rid) > 1})
    if repeated:  # two groups under one id would pass for one group's incarnations, the quorum one group short
        raise argparse.ArgumentTypeError(f"{', '.join(repeated)} given more than once in --replica-ids {text!r}: "
                                         f"give each group's id once")
    return checked


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535 (0: any free port), got {value}")
    return value
