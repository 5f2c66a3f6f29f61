"""Prompts as token ids, assembled from segments that are each tokenized once.

Layout of turn t (role tokens are special ids, never text)::

    <|system|> rules and GUI actions <|end|>
    <|user|> Task: instruction <|end|>
    for each of the last ``history_turns`` turns:
        <|user|> Step k. <|end|> <|assistant|> sampled ids <|end|> <|user|> Result: ... <|end|>
    <|user|> Step t. observation text, focused app's API <|end|> <|assistant|>

Past turns keep the exact ids the engine sampled (never re-tokenized) and show only their result, so a
prompt grows by a few dozen tokens per turn; the current observation is shown in full. Over
``max_prompt_tokens``, the oldest history goes first, then the observation text is shortened.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.tokenizer import Tokenizer
from env_server.actions import gui_action_help

DEFAULT_RULES = ("You operate a computer desktop to complete the task. Each turn you see the screen as an "
                 "accessibility tree: [id] role \"name\" = value (states). Reply with exactly one action, "
                 "a single Python-style call, then stop. Target elements by name or id. Call done() when the "
                 "task is complete and fail() if it is impossible.")


@dataclass
class PromptConfig:
    """How observations become prompts."""

    style: str = "full"
    """full: rules, GUI action list and the focused app's API | minimal: instruction and screen only"""
    history_turns: int = 4
    """past turns shown (their action and its result)"""
    max_prompt_tokens: int = 4096
    """prompts are cut to this many tokens (oldest history first, then the observation)"""
    max_obs_chars: int = 6000
    """observation text beyond this is cut"""
    max_result_chars: int = 300
    """a past turn's result text beyond this is cut"""

    def validate(self) -> None:
        if self.style not in ("full", "minimal"):
            raise ValueError("prompt style must be full or minimal")
        if self.max_prompt_tokens < 64 or self.history_turns < 0:
            raise ValueError("need max_prompt_tokens >= 64 and history_turns >= 0")


class EpisodePrompt:
    """The growing prompt of one episode."""

    def __init__(self, tok: Tokenizer, cfg: PromptConfig, instruction: str):
        self.tok, self.cfg = tok, cfg
        sys_, user, self.assistant, self.end = (tok.special(t) for t in
                                                ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"))
        self.user = user
        head: list[int] = []
        if cfg.style == "full":
            rules = DEFAULT_RULES + "\nGUI actions:\n" + "\n".join(gui_action_help())
            head += [sys_, *tok.encode(rules), self.end]
        head += [user, *tok.encode(f"Task: {instruction}"), self.end]
        self.head = head
        self.history: list[list[int]] = []  # one segment per past turn: result + sampled ids
        self.step = 0

    def _observation_ids(self, obs: dict, max_chars: int) -> list[int]:
        text = obs.get("text", "")
        if len(text) > max_chars:
            text = text[:max_chars] + "\n[... cut]"
        body = f"Step {self.step}.\n{text}"
        if self.cfg.style == "full" and obs.get("apis"):
            body += "\nAPI of the focused app: " + ", ".join(obs["apis"])
        return [self.user, *self.tok.encode(body), self.end, self.assistant]

    def build(self, obs: dict) -> list[int]:
        """The prompt for the current turn."""
        max_chars = self.cfg.max_obs_chars
        current = self._observation_ids(obs, max_chars)
        history = self.history[-self.cfg.history_turns:] if self.cfg.history_turns else []
        budget = self.cfg.max_prompt_tokens
        while len(self.head) + sum(map(len, history)) + len(current) > budget:
            if history:
                history = history[1:]
            elif max_chars > 200:
                max_chars //= 2
                current = self._observation_ids(obs, max_chars)
            else:
                # Nothing left to cut but the task itself: keep the end, where the newest text is.
                ids = [*self.head, *current]
                return ids[-budget:]
        return [*self.head, *(t for seg in history for t in seg), *current]

    def record(self, output_ids: list[int], result: str) -> None:
        """Remember a finished turn: its sampled ids verbatim, then the result the desktop reported."""
        ids = list(output_ids)
        if not ids or ids[-1] != self.end:
            ids.append(self.end)  # a turn cut at max_new_tokens still needs its end marker
        res = result if len(result) <= self.cfg.max_result_chars else result[:self.cfg.max_result_chars] + "..."
        self.history.append([self.user, *self.tok.encode(f"Step {self.step}."), self.end, self.assistant, *ids,
                             self.user, *self.tok.encode(f"Result: {res}"), self.end])
        self.step += 1
