"""Prompts as token ids: what an episode says (this conversation) and how a model reads it (a renderer).

The conversation of turn t::

    system: rules and GUI actions                      (style "full" only)
    user: Task: instruction
    for each of the last ``history_turns`` turns:
        user: Step k.    assistant: its sampled ids, verbatim    user: Result: ...
    user: Step t. observation text, focused app's API
    (assistant: the generation prompt)

Past turns keep the exact ids the engine sampled (never re-tokenized) and show only their result, so a prompt grows
by a few dozen tokens per turn; the current observation is shown in full. Over ``max_prompt_tokens``, the oldest
history goes first, then the observation text is shortened.

A vision-language policy (``model.kind: vlm``) sees the screen as a screenshot (``prompt.observation``: ``tree``,
``screenshot`` or ``both``): the current turn's user message carries the observation's screenshot, and the "Step k."
messages of the last ``history_images - 1`` past turns keep theirs. Images are known by content hash
(``common/images.py``); ``EpisodePrompt.images`` lists the ones the last prompt holds, in order.

Two renderers turn the conversation into ids (``prompt.format``):

- ``roles``: our role tokens around each message (``<|user|> text <|end|>``), for the byte-level policies and
  any tokenizer without a chat template (the role tokens are added to it).
- ``chat_template``: the tokenizer's own chat template, as a pretrained instruct model was trained to read it. The
  template renders the conversation as text with a marker in place of each past assistant turn; the text between
  markers is tokenized (special tokens by name) and each marker is replaced by that turn's sampled ids. Where the
  sampled ids end with a stop token and the template closes the turn with that same token, it is not added twice.
  Consecutive messages of one role are joined with a blank line, as many templates require alternating roles.
  A message with images is given to the template as content parts (images first, then its text); each image
  placeholder token the template writes is expanded to as many placeholders as that image takes
  (``VisionProcessor.tokens_for``), which is what a Hugging Face processor does to the text.

The ids this gives equal the template's own tokenization of the same conversation (with each assistant turn
written as the decoded text of its ids) except where keeping sampled ids verbatim must differ, which is by design:
a sampled token sequence that is not the tokenizer's canonical encoding of its text; a template that rewrites past
assistant turns (Qwen3's strips earlier ``<think>`` reasoning: here the reasoning stays, as sampled); and a turn
cut at ``max_new_tokens`` or a stop string, which the template's closing tokens follow. A trajectory records the
prompt ids exactly as the engine was fed them, so the learner scores what was sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from policy.tokenizer import Tokenizer
from common.images import Image
from env_server.actions import gui_action_help

DEFAULT_RULES = ("You operate a computer desktop to complete the task. Each turn you see the screen as an "
                 "accessibility tree: [id] role \"name\" = value (states). Reply with exactly one action, "
                 "a single Python-style call, then stop. Target elements by name or id. Call done() when the "
                 "task is complete and fail() if it is impossible.")
FORMATS = ("auto", "roles", "chat_template")
OBSERVATIONS = ("tree", "screenshot", "both")


@dataclass
class PromptConfig:
    """How observations become prompts."""

    style: str = "full"
    """full: rules, GUI action list and the focused app's API | minimal: instruction and screen only"""
    format: str = "auto"
    """auto (the tokenizer's chat template when it has one, else roles) | roles | chat_template"""
    template_kwargs: dict = field(default_factory=dict)
    """extra variables for the chat template (e.g. {enable_thinking: false} for Qwen3)"""
    observation: str = "tree"
    """what the policy sees of the screen: tree (accessibility text) | screenshot | both (a VLM's choices)"""
    history_images: int = 1
    """screenshots in a prompt: the current one and those of the last history_images - 1 past turns"""
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
        if self.format not in FORMATS:
            raise ValueError(f"prompt format must be one of {', '.join(FORMATS)}")
        if self.max_prompt_tokens < 64 or self.history_turns < 0:
            raise ValueError("need max_prompt_tokens >= 64 and history_turns >= 0")
        if self.observation not in OBSERVATIONS:
            raise ValueError(f"prompt observation must be one of {', '.join(OBSERVATIONS)}")
        if self.history_images < 1:
            raise ValueError("prompt history_images must be >= 1 (the current screenshot)")


@dataclass(frozen=True)
class Message:
    """One message of the conversation: text, or (an assistant turn) the ids the engine sampled."""

    role: str  # system | user | assistant
    text: str = ""
    ids: tuple[int, ...] | None = None
    images: tuple[Image, ...] = ()  # shown before the text


class Renderer(Protocol):
    def render(self, messages: list[Message]) -> list[int]:
        """The conversation as prompt ids, ending with the generation prompt of the assistant's next turn."""
        ...


class RoleTokenRenderer:
    """``<|role|> text <|end|>`` per message; an assistant turn is ``<|assistant|> ids`` (+ ``<|end|>`` when the
    turn was cut before it); the generation prompt is ``<|assistant|>``."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.role = {r: tok.special(f"<|{r}|>") for r in ("system", "user", "assistant")}
        self.end = tok.special("<|end|>")
        self._encoded: dict[str, list[int]] = {}  # each text is tokenized once per episode

    def _encode(self, text: str) -> list[int]:
        if text not in self._encoded:
            self._encoded[text] = self.tok.encode(text)
        return self._encoded[text]

    def render(self, messages: list[Message]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            if m.images:
                raise ValueError("images need a vision-language model and its chat template (model.kind vlm)")
            if m.ids is not None:
                ids += [self.role[m.role], *m.ids]
                if not m.ids or m.ids[-1] != self.end:
                    ids.append(self.end)  # a turn cut at max_new_tokens still needs its end marker
            else:
                ids += [self.role[m.role], *self._encode(m.text), self.end]
        ids.append(self.role["assistant"])
        return ids


class ChatTemplateRenderer:
    """The tokenizer's chat template, with past assistant turns spliced in as their sampled ids (module doc)."""

    MARKER = "\u27e6computerrl-turn-{}\u27e7"  # text no template changes (no whitespace to strip, no tags)

    def __init__(self, tok: Any, template_kwargs: dict | None = None):
        self.tok, self.kwargs = tok, dict(template_kwargs or {})

    @staticmethod
    def merged(messages: list[Message]) -> list[Message]:
        """Consecutive text messages of one role joined with a blank line (sampled turns are never joined)."""
        out: list[Message] = []
        for m in messages:
            if out and m.ids is None and out[-1].ids is None and out[-1].role == m.role:
                out[-1] = Message(m.role, out[-1].text + "\n\n" + m.text, images=out[-1].images + m.images)
            else:
                out.append(m)
        return out

    def render(self, messages: list[Message]) -> list[int]:
        chat, sampled, images = [], [], []
        for m in self.merged(messages):
            if m.ids is not None:
                chat.append({"role": m.role, "content": self.MARKER.format(len(sampled))})
                sampled.append(m.ids)
            elif m.images:
                chat.append({"role": m.role, "content": [*({"type": "image"} for _ in m.images),
                                                         {"type": "text", "text": m.text}]})
                images += m.images
            else:
                chat.append({"role": m.role, "content": m.text})
        text = self.tok.render_chat(chat, add_generation_prompt=True, **self.kwargs)
        pieces: list[tuple[str, tuple[int, ...] | None]] = []  # template text, or a sampled turn
        pos = 0
        for k, turn in enumerate(sampled):
            marker = self.MARKER.format(k)
            at = text.find(marker, pos)
            if at < 0:
                continue  # the template leaves this turn out
            pieces += [(text[pos:at], None), ("", turn)]
            pos = at + len(marker)
            if turn and turn[-1] in self.tok.stop_ids:
                closing = self.tok.token_text(turn[-1])
                if text.startswith(closing, pos):
                    pos += len(closing)  # the sampled stop token already closes the turn
        pieces.append((text[pos:], None))
        ids: list[int] = []
        pending = list(images)
        for piece, turn in pieces:
            ids += turn if turn is not None else self._expanded(self.tok.encode(piece), pending)
        if pending:
            raise ValueError(f"the chat template wrote {len(images) - len(pending)} image placeholders for "
                             f"{len(images)} images")
        return ids

    def _expanded(self, ids: list[int], pending: list[Image]) -> list[int]:
        """Template text ids with each image placeholder widened to its image's token count (images in order)."""
        vision = self.tok.vision
        if vision is None or vision.image_token_id not in ids:
            return ids
        out: list[int] = []
        for i in ids:
            if i != vision.image_token_id:
                out.append(i)
            elif not pending:
                raise ValueError("the chat template wrote more image placeholders than the prompt has images")
            else:
                out += [i] * vision.tokens_for(pending.pop(0))
        return out


def make_renderer(tok: Tokenizer, cfg: PromptConfig) -> Renderer:
    fmt = cfg.format
    if fmt == "auto":
        fmt = "chat_template" if tok.chat_template else "roles"
    if fmt == "chat_template":
        if not tok.chat_template:
            raise ValueError("prompt.format is chat_template but the tokenizer has no chat template "
                             "(tokenizer_config.json chat_template, or chat_template.jinja, in the model directory)")
        return ChatTemplateRenderer(tok, cfg.template_kwargs)
    if tok.chat_template:
        raise ValueError("prompt.format roles needs our role tokens, and this tokenizer has a chat template (no "
                         "token is added to a pretrained vocabulary): use prompt.format auto or chat_template")
    return RoleTokenRenderer(tok)


class EpisodePrompt:
    """The growing conversation of one episode, rendered for the current turn by ``build``."""

    def __init__(self, tok: Tokenizer, cfg: PromptConfig, instruction: str):
        self.tok, self.cfg = tok, cfg
        self.renderer = make_renderer(tok, cfg)
        head: list[Message] = []
        if cfg.style == "full":
            head.append(Message("system", DEFAULT_RULES + "\nGUI actions:\n" + "\n".join(gui_action_help())))
        head.append(Message("user", f"Task: {instruction}"))
        self.head = head
        self.history: list[list[Message]] = []  # per past turn: its step, its sampled ids, its result
        self.step = 0
        self.screenshots = cfg.observation != "tree"
        if self.screenshots and getattr(tok, "vision", None) is None:
            raise ValueError(f"prompt.observation {cfg.observation} needs a vision-language model (model.kind vlm)")
        self.current_image: Image | None = None
        self.images: list[Image] = []  # the images of the last prompt built, in order

    def _observation(self, obs: dict, max_chars: int) -> Message:
        text = obs.get("text", "") if self.cfg.observation != "screenshot" else ""
        if len(text) > max_chars:
            text = text[:max_chars] + "\n[... cut]"
        body = f"Step {self.step}." if self.cfg.observation == "screenshot" else f"Step {self.step}.\n{text}"
        if self.cfg.style == "full" and obs.get("apis"):
            body += "\nAPI of the focused app: " + ", ".join(obs["apis"])
        return Message("user", body, images=(self.current_image,) if self.current_image else ())

    def _with_images(self, history: list[list[Message]]) -> list[Message]:
        """The history's messages, the "Step k." of the last ``history_images - 1`` turns with their screenshots."""
        keep = self.cfg.history_images - 1
        out = []
        for n, turn in enumerate(history):
            step, *rest = turn
            if n < len(history) - keep:
                step = Message(step.role, step.text)
            out += [step, *rest]
        return out

    def build(self, obs: dict) -> list[int]:
        """The prompt for the current turn (its images: ``self.images``)."""
        if self.screenshots:
            shot = obs.get("screenshot")
            if not shot:
                raise ValueError(f"prompt.observation {self.cfg.observation}: the observation has no screenshot "
                                 "(env_server.sim.screenshot: png, or a real desktop)")
            self.current_image = Image.of(shot)
        max_chars = self.cfg.max_obs_chars
        current = self._observation(obs, max_chars)
        history = self.history[-self.cfg.history_turns:] if self.cfg.history_turns else []
        budget = self.cfg.max_prompt_tokens
        while True:
            messages = [*self.head, *self._with_images(history), current]
            ids = self.renderer.render(messages)
            if len(ids) <= budget:
                self.images = [img for m in ChatTemplateRenderer.merged(messages) if m.ids is None for img in m.images]
                return ids
            if history:
                history = history[1:]
            elif max_chars > 200:
                max_chars //= 2
                current = self._observation(obs, max_chars)
            elif self.screenshots:
                raise ValueError(f"prompt.max_prompt_tokens {budget} cannot hold the screenshot: the prompt needs "
                                 f"{len(ids)} tokens (raise it, or lower model.max_pixels)")
            else:
                self.images = []
                return ids[-budget:]  # nothing left to cut but the task itself: keep the end, the newest text

    def record(self, output_ids: list[int], result: str) -> None:
        """Remember a finished turn: its sampled ids verbatim, then the result the desktop reported."""
        res = result if len(result) <= self.cfg.max_result_chars else result[:self.cfg.max_result_chars] + "..."
        shot = (self.current_image,) if self.current_image else ()
        self.history.append([Message("user", f"Step {self.step}.", images=shot),
                             Message("assistant", ids=tuple(output_ids)), Message("user", f"Result: {res}")])
        self.step += 1
