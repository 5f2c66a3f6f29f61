"""Pretrained chat models: prompts through the checkpoint's own chat template, token-in/token-out kept.

The checkpoint is a tiny Qwen2 chat model built here (``launch.tiny_checkpoints``): a byte-level BPE trained on sim
text, a ChatML template, ``<|im_end|>`` and ``<|endoftext|>`` as its end-of-sequence ids."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from actor.demos import demonstrate  # noqa: E402
from actor.engine import EngineConfig, SamplingParams  # noqa: E402
from actor.hf_engine import HFEngine  # noqa: E402
from actor.prompt import ChatTemplateRenderer, EpisodePrompt, Message, PromptConfig  # noqa: E402
from policy.model import ModelConfig, build_tokenizer, sequence_logprobs  # noqa: E402
from policy.tokenizer import load_tokenizer  # noqa: E402
from env_server.sim.backend import SimBackend  # noqa: E402
from launch.tiny_checkpoints import chat_checkpoint  # noqa: E402

# A template that drops earlier reasoning from past assistant turns, as Qwen3's does (written here).
STRIPS_REASONING = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("chat"), corpus_episodes=30)


@pytest.fixture(scope="module")
def tok(chat_dir):
    return load_tokenizer("auto", str(chat_dir), str(chat_dir))


def template_ids(tok, conversation: list[dict]) -> list[int]:
    """The template's own rendering of a conversation, tokenized as one text (the reference)."""
    return tok.encode(tok.render_chat(conversation, add_generation_prompt=True))


def test_a_pretrained_vocabulary_is_used_as_it_is(chat_dir, tok):
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(chat_dir))
    assert tok.chat_template and tok.vocab_size == len(saved), "no token was added to the vocabulary"
    gen = json.loads((chat_dir / "generation_config.json").read_text())["eos_token_id"]
    assert tok.eos_id == saved.convert_tokens_to_ids("<|im_end|>") and tok.stop_ids == set(gen)
    with pytest.raises(ValueError, match="chat template"):
        EpisodePrompt(tok, PromptConfig(format="roles"), "x")
    with pytest.raises(ValueError, match="no chat template"):
        EpisodePrompt(load_tokenizer("byte"), PromptConfig(format="chat_template"), "x")
    assert build_tokenizer(ModelConfig(path=str(chat_dir))).chat_template, "tokenizer auto finds the files"


def test_a_multi_turn_episode_feeds_the_template_rendering_of_its_conversation(tok):
    """Each turn's prompt ids, as recorded in the trajectory, equal the template's rendering of the conversation so
    far (past actions written as text; the oracle's ids are the tokenizer's canonical ones, so no difference)."""
    pc = PromptConfig(style="full", history_turns=10, max_prompt_tokens=100_000)
    episode, seen = demonstrate(SimBackend(), "sim:train:files_rename/3", "gui", tokenizer=tok, prompt_cfg=pc)
    assert len(episode.turns) >= 3
    prompt = EpisodePrompt(tok, pc, seen[0][0]["instruction"])
    system = prompt.head[0].text
    instruction = seen[0][0]["instruction"]

    def observation(k: int, obs: dict) -> str:
        return f"Step {k}.\n{obs['text']}" + (f"\nAPI of the focused app: {', '.join(obs['apis'])}"
                                              if obs.get("apis") else "")

    for t, turn in enumerate(episode.turns):
        conv = [{"role": "system", "content": system}]
        user = f"Task: {instruction}"
        for k in range(t):
            conv += [{"role": "user", "content": f"{user}\n\nStep {k}."},
                     {"role": "assistant", "content": seen[k][1]}]
            user = f"Result: {seen[k + 1][0]['last_result']}"
        conv.append({"role": "user", "content": f"{user}\n\n{observation(t, seen[t][0])}"})
        assert turn.prompt_ids.tolist() == template_ids(tok, conv), f"turn {t}"
        # the sampled ids end with <|im_end|>, which the template's closing <|im_end|> does not repeat
        assert turn.output_ids[-1] == tok.eos_id
        if t:
            prev = episode.turns[t - 1].output_ids.tolist()
            ids = turn.prompt_ids.tolist()
            assert any(ids[i:i + len(prev)] == prev for i in range(len(ids))), "past ids go back verbatim"


def _split_at(ours: list[int], ref: list[int]) -> tuple[int, int]:
    """Lengths of the common prefix and common suffix of two id lists."""
    pre = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    suf = next((i for i, (a, b) in enumerate(zip(reversed(ours), reversed(ref))) if a != b),
               min(len(ours), len(ref)))
    return pre, suf


def test_sampled_ids_stay_verbatim_where_the_template_rendering_differs(tok):
    """Where the two must differ, they differ only inside the assistant turn, and it holds the sampled ids."""
    text = 'click("Save")'
    canonical = tok.encode(text)
    spelled = [i for ch in text for i in tok.encode(ch)]  # the same text, sampled one character at a time
    assert spelled != canonical and tok.decode(spelled) == text
    renderer = ChatTemplateRenderer(tok)
    msgs = [Message("user", "Task: save"), Message("assistant", ids=(*spelled, tok.eos_id)),
            Message("user", "Result: ok")]
    ours = renderer.render(msgs)
    ref = template_ids(tok, [{"role": "user", "content": "Task: save"}, {"role": "assistant", "content": text},
                             {"role": "user", "content": "Result: ok"}])
    at = next(i for i in range(len(ours)) if ours[i:i + len(spelled)] == spelled)
    assert ours[:at] == ref[:at] and ref[at:at + len(canonical)] == canonical
    assert ours[at + len(spelled):] == ref[at + len(canonical):], "the rest is the template's, token for token"

    # A turn cut before its stop token gets the template's closing tokens after it; one that ended with the other
    # stop id (<|endoftext|>) keeps it, and the template's <|im_end|> follows.
    cut = renderer.render([Message("user", "a"), Message("assistant", ids=tuple(canonical)), Message("user", "b")])
    assert cut == template_ids(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": text},
                                     {"role": "user", "content": "b"}])
    other = next(iter(tok.stop_ids - {tok.eos_id}))
    ended = renderer.render([Message("user", "a"), Message("assistant", ids=(*canonical, other)),
                             Message("user", "b")])
    at = len(tok.encode("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"))
    assert ended[at:at + len(canonical) + 2] == [*canonical, other, tok.eos_id]


def test_a_template_that_strips_past_reasoning_keeps_it_here(chat_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    d = tmp_path / "qwen3ish"
    shutil.copytree(chat_dir, d)
    raw = AutoTokenizer.from_pretrained(str(d))
    raw.chat_template = STRIPS_REASONING
    raw.save_pretrained(str(d))
    tok = load_tokenizer("hf", str(d), str(d))
    sampled = [*tok.encode("<think>the file is in Documents</think>open_app(\"Files\")"), tok.eos_id]
    reasoning = tok.encode("<think>the file is in Documents</think>")
    prompt = EpisodePrompt(tok, PromptConfig(style="minimal"), "rename x")
    prompt.build({"text": "screen 0"})
    prompt.record(sampled, "opened")
    ours = prompt.build({"text": "screen 1"})
    ref = template_ids(tok, [{"role": "user", "content": "Task: rename x\n\nStep 0."},
                             {"role": "assistant", "content": tok.decode(sampled[:-1])},
                             {"role": "user", "content": "Result: opened\n\nStep 1.\nscreen 1"}])
    pre, suf = _split_at(ours, ref)
    assert ours[pre:len(ours) - suf] == reasoning and len(ref) == pre + suf, "exactly the reasoning differs"


def test_prompts_are_cut_to_the_budget_oldest_history_first(tok):
    prompt = EpisodePrompt(tok, PromptConfig(style="minimal", history_turns=8, max_prompt_tokens=160), "rename x")
    for k in range(6):
        prompt.build({"text": f"screen {k}"})
        prompt.record([*tok.encode(f'click("item {k}")'), tok.eos_id], f"clicked item {k}")
    ids = prompt.build({"text": "screen 6 " + "row " * 20})
    text = tok.tok.decode(ids)
    assert len(ids) <= 160 and text.endswith("<|im_start|>assistant\n") and "screen 6" in text
    assert 'item 5' in text and 'item 0' not in text


def test_the_engine_stops_at_the_checkpoints_end_ids_and_scores_like_the_learner(chat_dir):
    eng = HFEngine(ModelConfig(path=str(chat_dir)), EngineConfig(seed=3))
    tok = eng.tokenizer
    prompt = EpisodePrompt(tok, PromptConfig(style="minimal"), "rename x").build({"text": "screen"})
    gens = eng.generate([prompt] * 6, SamplingParams(max_new_tokens=40, temperature=1.0))
    for g in gens:
        assert (g.finish == "eos") == (g.token_ids[-1] in tok.stop_ids) and tok.eos_id not in g.token_ids[:-1]
        with torch.no_grad():
            ref = sequence_logprobs(eng.model, torch.tensor([prompt + g.token_ids]), vocab=tok.vocab_size)
        np.testing.assert_allclose(np.array(g.logprobs), ref[0, len(prompt) - 1:].numpy(), atol=2e-5)


def test_a_trained_checkpoint_carries_the_tokenizer_and_template(chat_dir, tmp_path):
    from learner.config import LearnerConfig
    from learner.trainer import Trainer

    trainer = Trainer(LearnerConfig(), ModelConfig(path=str(chat_dir)))
    episode, _ = demonstrate(SimBackend(), "sim:train:files_rename/1", "gui", tokenizer=trainer.tokenizer,
                             prompt_cfg=PromptConfig(style="minimal"))
    assert trainer.sft_step([episode.trajectory("demo")], lr=1e-3) is not None
    out = trainer.export(tmp_path / "policy")
    again = build_tokenizer(ModelConfig(path=str(out)))
    assert again.chat_template and again.vocab_size == trainer.tokenizer.vocab_size
    assert again.stop_ids == trainer.tokenizer.stop_ids, "generation_config.json's end ids travel with the weights"
