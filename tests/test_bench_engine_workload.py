"""``bench engine``'s mixed workload: a turn's prompt begins with what it was recorded to share with its previous
turn's prompt and output, on both sides of the comparison; recorded files are checked as they load."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")

from actor.engine import EngineConfig  # noqa: E402
from actor.hf_engine import HFEngine, common_prefix  # noqa: E402
from launch.bench.engine import (Turn, _episode, _generate, _library, _library_submit, _ours, _play,  # noqa: E402
                                 load_workload)
from tests.test_engine import TINY  # noqa: E402


def test_a_turn_begins_with_its_shared_prefix_and_refuses_more_than_there_was():
    assert Turn([7, 8], out=3, shared=2).prompt([1, 2, 3, 4]) == [1, 2, 7, 8]
    assert Turn([7], out=1).prompt([1, 2]) == [7]
    with pytest.raises(ValueError, match="shares 5 tokens with a previous turn of 4"):
        Turn([7], out=1, shared=5).prompt([1, 2, 3, 4])
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_recorded_workloads_load_old_and_new_and_refuse_impossible_turns(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"episodes": [{"turns": [[10, 3], [20, 4]]}]}))
    assert load_workload(str(old)) == [[(10, 3, 0), (20, 4, 0)]]
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"episodes": [{"turns": [[10, 3, 0], [20, 4, 12]]}]}))
    assert load_workload(str(new)) == [[(10, 3, 0), (20, 4, 12)]]
    for turns in ([[10, 3, 2]], [[10, 3, 0], [20, 4, 14]], [[10, 3, 0], [12, 4, 12]], [[0, 3]]):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"episodes": [{"turns": turns}]}))
        with pytest.raises(ValueError, match="episode 0 turn"):
            load_workload(str(bad))
    with pytest.raises(FileNotFoundError, match="no engine workload"):
        load_workload(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshared"])
def test_both_sides_play_episodes_whose_turns_overlap_as_recorded(shared):
    eng = HFEngine(TINY, EngineConfig(seed=3, max_batch=4))
    tok = eng.tokenizer
    avoid = set(tok.stop_ids) | {tok.pad_id}
    recorded = [[(40, 5, 0), (60, 4, 42), (70, 3, 61)], [(30, 6, 0), (50, 2, 20)]] * 2
    episodes = [_episode(random.Random(i), ep, tok.vocab_size, avoid, shared) for i, ep in enumerate(recorded)]
    assert [len(t.tail) + t.shared for t in episodes[0]] == [40, 60, 70], "every prompt has its recorded length"
    ours = _ours(eng, episodes)
    assert ours["tokens"] == sum(o for ep in recorded for _, o, _ in ep)
    # the second turns' 42 and 20 shared tokens and the third's 61 come from the slot each episode's turn left
    # (less the one token a reused prompt always prefills); unshared, nothing is reused
    if shared:
        assert ours["prefix_reused_share"] > 0.3
    else:
        assert ours["prefix_reused_share"] == 0.0
    assert 0 < ours["prefill_share"] < 1
    # the busy time by phase: every turn's prompt went through a pass (10 turns, 4 slots: more than one pass, fewer
    # passes than turns where turns arrive together), and every token but a turn's first through a decode step
    assert 1 < ours["prefill_passes"] <= 10 and ours["prompt_tokens_per_pass"] > 0 and ours["prefill_ms_per_pass"] > 0
    assert ours["windows"] >= max(o for ep in recorded for _, o, _ in ep) - 1 and ours["decode_ms_per_step"] > 0
    base = _generate(eng.model, tok, "cpu", episodes, batch=2)
    assert base["tokens"] == ours["tokens"] and base["seconds"] > 0
    eng.close()


def test_every_episodes_first_turn_is_queued_before_the_engine_admits_any():
    """``generate`` gets its batch whole; ours must too, or its first window takes the first few turns alone."""
    eng = HFEngine(TINY, EngineConfig(seed=3, max_batch=4))

    class Watched:  # the engine, noting whether it was paused at each submit
        def __init__(self):
            self.stats, self.paused, self.submits = eng.stats, False, []

        def pause(self):
            self.paused = True
            eng.pause()

        def resume(self):
            self.paused = False
            eng.resume()

        def submit(self, *args, **kwargs):
            self.submits.append(self.paused)
            return eng.submit(*args, **kwargs)

        def wait_idle(self):
            eng.wait_idle()

    tok = eng.tokenizer
    avoid = set(tok.stop_ids) | {tok.pad_id}
    episodes = [_episode(random.Random(i), [(12, 3, 0), (20, 2, 0)], tok.vocab_size, avoid) for i in range(4)]
    watched = Watched()
    assert _ours(watched, episodes)["tokens"] == 4 * (3 + 2)
    assert watched.submits == [True] * 4 + [False] * 4, "first turns while paused, the rest as turns end"
    assert not watched.paused
    eng.close()


def test_the_library_arm_plays_each_turn_after_its_previous_one_with_what_it_generated():
    """``bench engine --library``'s side of the manager, on a stand-in: the shared episode loop adds every first turn
    at once and a later turn only when its previous turn's result came back through the handler registered for it,
    with that turn's prompt and output leading its prompt; a refused request or a silent manager raises, saying so."""
    import asyncio
    from types import SimpleNamespace

    class Manager:
        def __init__(self, answer=True, accept=True):
            self.added, self.handlers, self.answer, self.accept = [], {}, answer, accept

        def register_result_handler(self, rid, callback):
            self.handlers[rid] = (callback, asyncio.get_running_loop())

        def add_request(self, prompt, request_id, max_new_tokens, record_timestamps):
            assert request_id in self.handlers, "the handler is registered before the request"
            self.added.append((request_id, list(prompt)))
            if not self.accept:
                return None
            callback, loop = self.handlers[request_id]
            out = SimpleNamespace(is_finished=lambda: True, error=None, created_time=0.0,
                                  generated_tokens=[900 + k for k in range(max_new_tokens)],
                                  timestamps=[0.5] * max_new_tokens)
            if self.answer:
                loop.call_soon_threadsafe(callback, out)
            return request_id

    episodes = [[Turn([1, 2, 3], out=2), Turn([7], out=1, shared=4)], [Turn([4, 5], out=3)]]
    m, first = Manager(), []
    assert _play(_library_submit(m, first), episodes) == 2 + 1 + 3 and first == [0.5, 0.5, 0.5]
    assert [rid for rid, _ in m.added] == ["r0", "r1", "r2"], "first turns at once, the second after the first"
    assert dict(m.added)["r2"] == [1, 2, 3, 900, 7], "its recorded 4 shared tokens: the last prompt and output"
    with pytest.raises(RuntimeError, match="returned nothing for r0 in 0 s"):
        _play(_library_submit(Manager(answer=False), [], wait_s=0.2), episodes)
    with pytest.raises(RuntimeError, match="refused request r0"):
        _play(_library_submit(Manager(accept=False), []), episodes)


def test_transformers_continuous_batching_plays_the_bench_workload_and_gives_the_engine_its_attention_back():
    eng = HFEngine(TINY, EngineConfig(seed=3, max_batch=4))
    tok = eng.tokenizer
    attention = eng.model.config._attn_implementation
    avoid = set(tok.stop_ids) | {tok.pad_id}
    recorded = [[(30, 4, 0), (45, 3, 33)], [(20, 5, 0)]]
    episodes = [_episode(random.Random(i), ep, tok.vocab_size, avoid) for i, ep in enumerate(recorded)]
    warm = [_episode(random.Random(9), [(30, 2, 0)], tok.vocab_size, avoid)]
    lib = _library(eng.model, tok, "cpu", episodes, 2, False, 256, warm)
    assert lib["tokens"] == 4 + 3 + 5, "every turn generates exactly its recorded length"
    assert lib["seconds"] > 0 and lib["ttft_s"] > 0 and lib["cuda_graphs"] is False
    assert eng.model.config._attn_implementation == attention, "the engine's decode attention is back"
    assert _ours(eng, episodes)["tokens"] == lib["tokens"]
    eng.close()


def test_the_baselines_run_on_transformers_attention_with_their_padding_masks(monkeypatch):
    """``generate`` in ``bench engine`` and ``bench actor`` is what a user gets without our engine: transformers' own
    attention, which masks the left padding. On the engine's attention transformers builds no mask at all, so a
    baseline run there would attend over padding and be timed on other kernels."""
    import threading

    import actor.slot_attention as slot_attention
    from actor.engine import SamplingParams, left_pad
    from launch.bench.actor import _hf_generate

    ours = []
    attend = slot_attention.slot_decode_attention

    def seen(*args, **kwargs):
        ours.append(threading.current_thread().name)
        return attend(*args, **kwargs)

    monkeypatch.setattr(slot_attention, "slot_decode_attention", seen)  # (registered by the engine below)
    eng = HFEngine(TINY, EngineConfig(seed=3, max_batch=4))
    tok, model = eng.tokenizer, eng.model
    avoid = set(tok.stop_ids) | {tok.pad_id}
    episodes = [_episode(random.Random(i), [(12 + 9 * i, 3, 0)], tok.vocab_size, avoid) for i in range(2)]
    assert _generate(model, tok, "cpu", episodes, batch=2)["tokens"] == 6
    prompts = [tok.encode("a short one"), tok.encode("a longer prompt, padded on the left of the short one")]
    assert _hf_generate(eng, [(prompts, SamplingParams(max_new_tokens=4), [[], []])], "cpu")[0] > 0
    assert ours == [], "no baseline call reached the engine's attention"
    assert model.config._attn_implementation == slot_attention.ATTENTION, "the engine's attention is back after"
    with slot_attention.library_attention(model), torch.no_grad():
        ids, mask = left_pad(prompts, tok.pad_id)
        padded = model(input_ids=ids, attention_mask=mask).logits[0, -1]
        alone = model(input_ids=torch.tensor([prompts[0]])).logits[0, -1]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)
    assert eng.generate([prompts[0]], SamplingParams(max_new_tokens=3))[0].token_ids and ours, "the engine's own"
    eng.close()


def test_overlap_both_plays_each_workload_overlapped_then_in_step_on_one_engine():
    """``bench engine --overlap both``: the same episodes once with overlapped windows and once in step, each figure
    from its own run (the overlapped one's late rows are its own)."""
    from launch.bench.engine import run_bench

    out = run_bench(hidden=16, layers=1, batches=(4,), prompt_len=16, new_tokens=8, mixed_batch=4, mixed_episodes=4,
                    group_size=2, overlap="both")
    assert out["overlap"] == "both"
    for name in ("fixed_4", "mixed"):
        w = out[name]
        assert w["in_step_tokens_per_s"] > 0 and 0 < w["in_step_mean_batch"] <= 4, w
        assert abs(w["overlap_gain"] - w["tokens_per_s"] / w["in_step_tokens_per_s"]) < 0.01, w
        assert w["in_step_late_row_share"] == 0, "in step, no row decodes past its request's end"
    # every bench turn ends at its budget (min_new_tokens): its slot goes back before its last window is read
    assert out["fixed_4"]["late_row_share"] == 0 and out["mixed"]["late_row_share"] == 0
