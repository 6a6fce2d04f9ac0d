"""What the users say: short questions, agent sessions whose prompt grows every turn, long
documents. Deterministic text from a seeded generator; no data set is downloaded."""

from __future__ import annotations

import random
import uuid

Messages = list[dict[str, str]]

SHORT_QUESTIONS = (
    "What is the capital of France?",
    "Give me three names for a grey cat.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 3?",
    "Name a planet with rings.",
    "Write a haiku about tea.",
    "What colour is a ripe banana?",
)

AGENT_SYSTEM = (
    "You are a careful software agent working in a Python repository. You can call tools by "
    "answering with one line `CALL tool(arguments)`: read_file(path) returns a file, "
    "list_dir(path) lists a folder, run_tests(pattern) runs the tests that match, and "
    "edit(path, old, new) replaces text in a file. Think step by step, call one tool at a "
    "time, read every tool result before the next call, never invent a file's contents, and "
    "finish with `DONE` and a one-line summary of what you changed and why. Keep answers short."
)
AGENT_TASKS = (
    "The test test_parse_dates fails on leap years. Find the bug and fix it.",
    "Add a --verbose flag to the command line tool and document it.",
    "The cache grows without bound. Give it a size limit with least-recently-used eviction.",
    "Rename the function get_usr to get_user everywhere and keep the tests passing.",
)

_WORDS = ("river", "stone", "window", "market", "engine", "garden", "letter", "signal",
          "harbor", "meadow", "lantern", "ledger", "orbit", "canvas", "thunder", "copper",
          "valley", "archive", "compass", "forest", "station", "mirror", "harvest", "bridge")


def short_chat(rng: random.Random) -> Messages:
    return [{"role": "user", "content": rng.choice(SHORT_QUESTIONS)}]


class AgentSession:
    """A multi-turn session: the system prompt, the task, then every reply and tool result so
    far. Its id goes in `x-session-affinity`, so each turn lands where its prefix is cached."""

    def __init__(self, rng: random.Random, turns: int) -> None:
        self.id = f"agent-{uuid.UUID(int=rng.getrandbits(128)).hex}"
        self.rng, self.turns, self.turn = rng, turns, 0
        self.messages: Messages = [{"role": "system", "content": AGENT_SYSTEM},
                                   {"role": "user", "content": rng.choice(AGENT_TASKS)}]

    @property
    def done(self) -> bool:
        return self.turn >= self.turns

    def answered(self, reply: str) -> None:
        """The model replied: it and a tool's result join the conversation."""
        self.turn += 1
        listing = ", ".join(f"{self.rng.choice(_WORDS)}_{i}.py" for i in range(6))
        self.messages += [{"role": "assistant", "content": reply},
                          {"role": "user", "content": f"Tool result {self.turn}: {listing}"}]


def long_context(rng: random.Random, words: int) -> Messages:
    """A document of about `words` words, then a question about it. Its first line is unique,
    so no two documents share a cached prefix past the chat template's own: a full prefill."""
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    document = f"Document {uuid.UUID(int=rng.getrandbits(128)).hex}.\n{body}"
    return [{"role": "user", "content": f"{document}\n\nWhich word appears most often above?"}]
