"""The load test's own command-line options, and `--max-iterations`: each user that is not
background load stops after that many iterations, and the run ends once they all have."""

from __future__ import annotations

import os
from typing import Any

import gevent
from locust import events
from locust.exception import StopUser
from locust.runners import STATE_RUNNING

# NOTE: the CSV writer refreshes its files once a second; waiting longer than that before
# quitting puts every last request in them.
QUIT_AFTER_S = 1.5


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    group = parser.add_argument_group("tessera")
    group.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY", ""),
                       help="the well-behaved tenant's key (default: $TESSERA_API_KEY)")
    group.add_argument("--abuser-api-key", default=os.environ.get("TESSERA_ABUSER_API_KEY", ""),
                       help="the abusive tenant's key (AbusiveTenant)")
    group.add_argument("--grpc-target", default="127.0.0.1:50051",
                       help="gRPC gateway address (--host is the REST shim's URL)")
    group.add_argument("--model", default="",
                       help="model id (default: the gateway's default; REST: the first listed)")
    group.add_argument("--max-tokens", type=int, default=32, help="tokens per reply")
    group.add_argument("--max-iterations", type=int, default=0,
                       help="iterations per user (0: until --run-time); the run ends when every "
                            "user but the abuser has done its iterations")
    group.add_argument("--agent-turns", type=int, default=4, help="turns per agent session")
    group.add_argument("--long-context-words", type=int, default=1500,
                       help="words of document in each long-context prompt")
    group.add_argument("--abuse-burst", type=int, default=16,
                       help="requests the abusive tenant sends at once, over and over")


class Iterations:
    """Counts the iterations of bounded users; stops each at the limit."""

    def __init__(self) -> None:
        self.users = 0
        self.finished = 0

    def started(self) -> None:
        self.users += 1

    def done(self, count: int, limit: int) -> None:
        """Called after each iteration of a bounded user with how many it has run."""
        if limit and count >= limit:
            self.finished += 1
            raise StopUser()


ITERATIONS = Iterations()


@events.test_start.add_listener
def watch_iterations(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if options is None or not options.max_iterations or environment.runner is None:
        return

    def watch() -> None:
        runner = environment.runner
        while not (runner.state == STATE_RUNNING and ITERATIONS.users
                   and ITERATIONS.finished >= ITERATIONS.users):
            gevent.sleep(0.25)
        gevent.sleep(QUIT_AFTER_S)
        runner.quit()

    gevent.spawn(watch)
