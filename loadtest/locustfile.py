"""The scenarios, as locust user classes (pick them by name on the command line):

- ShortChatGrpc / ShortChatRest: one short question per request (REST alternates between
  /v1/chat/completions and /ai/run).
- AgentGrpc / AgentRest: multi-turn agent sessions whose prompt grows every turn, sent with
  `x-session-affinity`; CACHED rows show the prefix reuse.
- LongContextGrpc: a long document and one question (prefill-heavy).
- AbusiveTenant: one user with --abuser-api-key sending --abuse-burst requests at once, over
  and over, with no pause: background load for the mixed-tenant scenario.

    python3 -m locust -f loadtest/locustfile.py --headless -u 4 -r 4 -t 60s \\
        --api-key KEY --csv out/short ShortChatGrpc ShortChatRest
"""

from __future__ import annotations

import random

from gevent.pool import Group
from locust import constant

from loadtest.scenarios import AgentSession, long_context, short_chat
from loadtest.users import GrpcUser, RestUser, TesseraUser

__all__ = ["AbusiveTenant", "AgentGrpc", "AgentRest", "LongContextGrpc", "ShortChatGrpc",
           "ShortChatRest"]


class ShortChatGrpc(GrpcUser):
    def once(self) -> None:
        self.chat(short_chat(random.Random()), scenario="short")


class ShortChatRest(RestUser):
    def once(self) -> None:
        call = self.chat if self.iterations % 2 == 0 else self.ai_run
        call(short_chat(random.Random()), scenario="short")


class _Agent(TesseraUser):
    abstract = True
    session: AgentSession | None = None

    def once(self) -> None:
        if self.session is None or self.session.done:
            self.session = AgentSession(random.Random(), self.options.agent_turns)
        reply = self.chat(self.session.messages, scenario="agent", session=self.session.id)
        if reply is None:
            self.session = None  # start a fresh session after a failed turn
        else:
            self.session.answered(reply)


class AgentGrpc(_Agent, GrpcUser):
    pass


class AgentRest(_Agent, RestUser):
    pass


class LongContextGrpc(GrpcUser):
    def once(self) -> None:
        self.chat(long_context(random.Random(), self.options.long_context_words),
                  scenario="long")


class AbusiveTenant(GrpcUser):
    key_option = "abuser_api_key"
    background = True
    fixed_count = 1
    wait_time = constant(0)

    def on_start(self) -> None:
        super().on_start()
        self.burst = Group()

    def once(self) -> None:
        for _ in range(self.options.abuse_burst):
            self.burst.spawn(self.chat, short_chat(random.Random()), scenario="abuse")
        self.burst.join()

    def on_stop(self) -> None:
        # NOTE: its calls end with the user, unrecorded, before the channel closes under them.
        self.burst.kill()
        super().on_stop()
