"""The HF engine's continuous batching on CPU: requests join and leave a running batch, every token's log-prob
equals a teacher-forced pass whatever the slot, window, chunking or reused prefix, and bad requests or a failing
step are refused or failed one by one, never stalling the engine."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from actor.engine import EngineConfig, SamplingParams  # noqa: E402
from actor.hf_engine import HFEngine  # noqa: E402
from actor.slot_attention import slot_decode_attention  # noqa: E402
from policy.model import ModelConfig, build_model, sequence_logprobs  # noqa: E402
from tests.conftest import REPO, stage_weights_before_window  # noqa: E402

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _teacher_forced(model, prompt, gen, temperature=1.0):
    with torch.no_grad():
        return sequence_logprobs(model, torch.tensor([prompt + gen.token_ids]),
                                 temperature=temperature or 1.0)[0, len(prompt) - 1:].numpy()


def _agree(eng, prompts, gens, temperature=1.0):
    for p, g in zip(prompts, gens):
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) > 0
        np.testing.assert_allclose(np.array(g.logprobs), _teacher_forced(eng.model, p, g, temperature), atol=3e-5)


@pytest.mark.parametrize("cfg", [dict(max_batch=3, sync_every=1), dict(max_batch=4, sync_every=5, prefill_tokens=24),
                                 dict(max_batch=8, sync_every=3, prefix_reuse=False),
                                 dict(max_batch=3, sync_every=1, overlap="always"),
                                 dict(max_batch=4, sync_every=5, prefill_tokens=24, overlap="always")],
                         ids=["per-token", "windows+chunked-prefill", "no-reuse", "per-token-overlapped",
                              "windows+chunked-prefill-overlapped"])
def test_more_requests_than_slots_of_mixed_lengths_and_params_agree_with_the_learner(cfg):
    eng = HFEngine(TINY, EngineConfig(seed=5, **cfg))
    tok = eng.tokenizer
    prompts = [tok.encode("go " * (1 + 7 * (i % 4)) + str(i)) for i in range(11)]
    mixes = [SamplingParams(temperature=1.0, max_new_tokens=3 + 5 * (i % 3)) for i in range(4)] + \
            [SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=12, stop=[")"])] * 4 + \
            [SamplingParams(temperature=0, max_new_tokens=9)] * 3
    futures = [eng.submit(p, s) for p, s in zip(prompts, mixes)]
    gens = [f.result(60) for f in futures]
    for p, s, g in zip(prompts, mixes, gens):
        assert len(g.token_ids) <= s.max_new_tokens
        assert g.finish in ("eos", "stop", "length")
        assert g.finish != "length" or len(g.token_ids) == s.max_new_tokens
        if g.finish == "stop":
            assert g.text.endswith(")") and ")" not in g.text[:-1], "cut at the token that completed the stop string"
        _agree(eng, [p], [g], s.temperature)
    assert eng.stats.decode_rows / eng.stats.decode_steps > 1.5, "requests decoded together"
    eng.close()


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_a_short_request_leaves_while_a_long_one_decodes_and_a_late_one_joins(overlap):
    eng = HFEngine(TINY, EngineConfig(seed=1, max_batch=4, overlap=overlap))
    tok = eng.tokenizer
    done_at: dict[str, float] = {}
    long = eng.submit(tok.encode("long"), SamplingParams(max_new_tokens=120, min_new_tokens=120))
    short = eng.submit(tok.encode("short"), SamplingParams(max_new_tokens=4, min_new_tokens=4))
    short.add_done_callback(lambda f: done_at.setdefault("short", time.perf_counter()))
    assert len(short.result(30).token_ids) == 4
    assert not long.done(), "the short request did not wait for the long one"
    late = eng.submit(tok.encode("late"), SamplingParams(max_new_tokens=4, min_new_tokens=4))
    assert len(late.result(30).token_ids) == 4 and not long.done(), "a late request joined the running batch"
    g = long.result(60)
    assert len(g.token_ids) == 120 and g.finish == "length"
    assert not set(g.token_ids[:-1]) & set(tok.stop_ids), "min_new_tokens keeps stop tokens out"
    eng.close()


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_a_later_turn_reuses_the_slot_holding_its_prefix(overlap):
    eng = HFEngine(TINY, EngineConfig(seed=2, max_batch=4, overlap=overlap))
    tok = eng.tokenizer
    first = tok.encode("a long shared history of the episode " * 4)
    g1 = eng.generate([first], SamplingParams(max_new_tokens=10))[0]
    second = first + g1.token_ids + tok.encode(" and the desktop answered")
    reused0 = eng.stats.prefix_reused_tokens
    g2 = eng.generate([second], SamplingParams(max_new_tokens=10))[0]
    assert eng.stats.prefix_reused_tokens - reused0 == len(first) + len(g1.token_ids) - 1
    _agree(eng, [second], [g2])
    before = eng.stats.prefix_reused_tokens
    eng.load_weights(dict(build_model(ModelConfig(**{**TINY.__dict__, "init_seed": 7}),
                                      tok.vocab_size).named_parameters()), 3)
    g3 = eng.generate([second + g2.token_ids], SamplingParams(max_new_tokens=5))[0]
    assert eng.stats.prefix_reused_tokens == before, "nothing computed by the old weights is reused"
    assert set(g3.versions) == {3}
    _agree(eng, [second + g2.token_ids], [g3])
    eng.close()


def _submit_from_window(eng, when, prompt, params) -> dict:
    """Submit ``prompt`` from the engine's own thread before the first decode window at which ``when()`` holds:
    at a known point of another request's decoding, whatever the machine's speed."""
    out: dict = {}

    def hook() -> None:
        if "future" not in out and when():
            out["future"] = eng.submit(prompt, params)
    eng.step_hook = hook
    return out


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_a_groups_rollouts_prefill_their_shared_prompt_once_and_later_ones_copy_it_from_a_running_slot(overlap):
    """G rollouts of a group start from one prompt, admitted together: one forward pass prefills it, the others copy
    its columns and sample their first tokens from its logits; a turn that shares a running request's prompt
    copies it from that slot and prefills the rest; all agree with the teacher-forced pass."""
    eng = HFEngine(TINY, EngineConfig(seed=4, max_batch=6, sync_every=2, overlap=overlap))
    tok = eng.tokenizer
    prompt = tok.encode("the task, its rules and the first screen of the desktop " * 2)
    eng.pause()  # the group arrives in one window, as an actor submits it
    group = [eng.submit(prompt, SamplingParams(max_new_tokens=14)) for _ in range(4)]
    eng.resume()
    gens = [f.result(60) for f in group]
    assert eng.stats.prefix_copies == 3 and eng.stats.prefix_reused_tokens == 3 * len(prompt)
    assert eng.stats.prompt_tokens == len(prompt) and eng.stats.prefill_batches == 1, "one prefill for the group"
    _agree(eng, [prompt] * 4, gens)
    assert len({tuple(g.token_ids) for g in gens}) > 1, "each rollout samples its own continuation"

    # a later turn sharing the prompt of a request still decoding (no free slot's leftovers share it)
    other = tok.encode("another task entirely, with its own first screen")
    later = other + tok.encode(" then a different observation")
    copies, reused = eng.stats.prefix_copies, eng.stats.prefix_reused_tokens
    sent = _submit_from_window(eng, lambda: any(r.prompt == other for r in eng._by_slot.values()), later,
                               SamplingParams(max_new_tokens=6))
    # (min_new_tokens keeps it decoding; its log-probs then leave out the banned stop tokens, so only the later
    # turn is checked against the teacher-forced pass)
    eng.generate([other], SamplingParams(max_new_tokens=30, min_new_tokens=30))
    eng.step_hook = None
    assert eng.stats.prefix_copies == copies + 1 and eng.stats.prefix_reused_tokens == reused + len(other)
    _agree(eng, [later], [sent["future"].result(60)])
    eng.close()


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_a_copy_whose_source_finished_at_its_own_prefill_still_copies_that_slot(overlap):
    """Admitted together: the source's one token comes from its prefill, so it finishes in the admission that copies
    its prefix."""
    eng = HFEngine(TINY, EngineConfig(seed=8, max_batch=4, overlap=overlap))
    tok = eng.tokenizer
    prompt = tok.encode("one prompt for two requests admitted in the same window " * 2)
    eng.pause()
    short = eng.submit(prompt, SamplingParams(max_new_tokens=1))
    longer = prompt + tok.encode(" and a little more")  # not the same prompt: a copy, then a prefill of its own
    g = eng.submit(longer, SamplingParams(max_new_tokens=6))
    eng.resume()
    assert len(short.result(60).token_ids) == 1
    _agree(eng, [longer], [g.result(60)])
    assert eng.stats.prefix_copies == 1 and eng.stats.prefill_batches == 2
    eng.close()


def test_the_host_reads_the_device_once_per_window_and_once_per_admission(monkeypatch):
    """However many prefill passes an admission takes (here short and chunked prompts, a group's twins and a copy),
    its first tokens come to the host in one read at its end: on a GPU a read waits for everything queued, so a
    read per pass would stop the host queueing the next pass while the GPU runs this one. Every read the engine's
    thread makes is counted by the function that made it."""
    import sys

    reads: dict[str, int] = {}
    tolist = torch.Tensor.tolist

    def counted(self):
        if threading.current_thread().name.startswith("hf-engine"):
            name = sys._getframe(1).f_code.co_name
            reads[name] = reads.get(name, 0) + 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    eng = HFEngine(TINY, EngineConfig(seed=3, max_batch=8, sync_every=4, prefill_tokens=32))
    tok = eng.tokenizer
    group = tok.encode("a prompt the rollouts of one group share, whole ")
    prompts = [tok.encode("go " * (1 + 5 * i)) for i in range(4)] + [group] * 3 + [group + tok.encode(" and more")]
    eng.pause()  # all queued: one admission takes them all
    futures = [eng.submit(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    eng.resume()
    gens = [f.result(60) for f in futures]
    _agree(eng, prompts, gens)
    assert eng.stats.prefill_batches >= 4 and eng.stats.prefix_copies >= 3, eng.stats
    assert reads == {"_take_first_tokens": 1, "_window": eng.stats.batches}, reads
    eng.close()


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_a_request_placed_before_a_swap_is_no_source_for_one_placed_after(overlap):
    eng = HFEngine(TINY, EngineConfig(seed=6, max_batch=4, sync_every=2, overlap=overlap))
    tok = eng.tokenizer
    prompt = tok.encode("a prompt that a later request shares, whole " * 2)
    later = prompt + tok.encode(" and more")
    newer = build_model(ModelConfig(**{**TINY.__dict__, "init_seed": 13}), tok.vocab_size)
    windows = {"n": 0}

    def when() -> bool:  # weights staged before the 2nd window land at the 3rd; the later turn comes after them
        windows["n"] += 1
        if windows["n"] == 2:
            eng.load_weights(dict(newer.named_parameters()), 2)
        return eng.stats.weight_swaps == 1
    sent = _submit_from_window(eng, when, later, SamplingParams(max_new_tokens=5))
    old = eng.generate([prompt], SamplingParams(max_new_tokens=20, min_new_tokens=20))[0]
    eng.step_hook = None
    g = sent["future"].result(60)
    assert old.versions[0] == 0 and old.versions[-1] == 2, "the swap landed while the first request decoded"
    assert eng.stats.prefix_copies == eng.stats.prefix_reused_tokens == 0, "no column of the old weights is reused"
    assert set(g.versions) == {2}
    _agree(eng, [later], [g])
    eng.close()


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_a_request_that_straddled_a_swap_leaves_no_prefix_to_reuse(overlap):
    """Its prompt's columns were written by the old weights and its last ones by the new: the next turn sharing
    that prompt prefills afresh (a lent H100 caught this: log-probs off the new weights' teacher-forced pass)."""
    eng = HFEngine(TINY, EngineConfig(seed=3, max_batch=2, sync_every=2, overlap=overlap))
    tok = eng.tokenizer
    prompt = tok.encode("an episode's history, long enough to be worth reusing " * 2)
    newer = build_model(ModelConfig(**{**TINY.__dict__, "init_seed": 11}), tok.vocab_size)
    stage_weights_before_window(eng, 2, dict(newer.named_parameters()), 4)
    mid = eng.generate([prompt], SamplingParams(max_new_tokens=12, min_new_tokens=12))[0]
    eng.step_hook = None
    assert mid.versions[0] == 0 and mid.versions[-1] == 4, "the swap landed mid-request"
    reused = eng.stats.prefix_reused_tokens
    again = eng.generate([prompt + mid.token_ids], SamplingParams(max_new_tokens=6))[0]
    assert eng.stats.prefix_reused_tokens == reused
    assert set(again.versions) == {4}
    _agree(eng, [prompt + mid.token_ids], [again])
    eng.close()


def test_overlapped_windows_sample_what_windows_in_step_sample_and_a_paused_engine_hands_back_the_last_one():
    """Overlapped, the host reads a window's results while the next window runs, so a request that ended at a stop
    in the first still decodes in the second, thrown away (one at its budget gives its slot back before: the next
    test). Every token kept is still the in-step engine's (greedy), over a group's twins, copies, reused slots,
    chunked prompts and budgets of one token, and the late rows are counted apart from the mean batch. A pause hands
    back the window in flight, ``wait_idle`` waits for the last read, and ``use_overlap(False)`` puts the engine back
    in step (``bench engine --overlap both``'s switch)."""
    def play(overlap: str):
        eng = HFEngine(TINY, EngineConfig(seed=9, max_batch=5, sync_every=3, prefill_tokens=40, overlap=overlap))
        tok = eng.tokenizer
        group = tok.encode("the task and the first screen the rollouts of a group share ")
        firsts = [group] * 3 + [tok.encode("go " * 20), tok.encode("a shorter one")]
        said = eng.generate([firsts[4]], SamplingParams(temperature=0, max_new_tokens=9))[0].text
        budgets, stops = [1, 7, 12, 2, 9], [[], [], [], [], [said[3:5]]]  # the last one stops at its 5th token
        greedy = [SamplingParams(temperature=0, max_new_tokens=n, stop=s) for n, s in zip(budgets, stops)]
        eng.pause()  # one admission takes the first turns
        futures = [eng.submit(p, s) for p, s in zip(firsts, greedy)]
        eng.resume()
        gens = [f.result(60) for f in futures]
        seconds = [p + g.token_ids + tok.encode(" then the desktop answered") for p, g in zip(firsts, gens)]
        gens += eng.generate(seconds, SamplingParams(temperature=0, max_new_tokens=10))
        _agree(eng, firsts + seconds, gens, temperature=0)
        stats = eng.stats
        eng.close()
        return gens, stats

    (in_step, stepped), (overlapped, ahead) = play("never"), play("always")
    assert [g.token_ids for g in overlapped] == [g.token_ids for g in in_step]
    assert [g.finish for g in overlapped] == [g.finish for g in in_step]
    assert [g.finish for g in in_step[:5]] == ["length"] * 4 + ["stop"], in_step
    assert ahead.prefix_copies == stepped.prefix_copies >= 2 and ahead.prefix_reused_tokens > 0
    assert stepped.late_rows == 0 < ahead.late_rows
    assert ahead.decode_rows / ahead.decode_steps <= 5

    eng = HFEngine(TINY, EngineConfig(seed=1, max_batch=2, sync_every=4, overlap="always"))
    eng.step_hook = eng.pause  # paused as its first window is queued
    g = eng.submit(eng.tokenizer.encode("paused"), SamplingParams(max_new_tokens=5, min_new_tokens=5))
    assert len(g.result(30).token_ids) == 5, "its first token and its first window's four came back in the pause"
    assert not eng._running.is_set()
    eng.step_hook = None
    eng.resume()
    eng.close()

    # a stop string in its first window ends it; the host learns so while the second window runs, which it reads
    # after the request resolved (here slowly): wait_idle returns once it has
    eng = HFEngine(TINY, EngineConfig(seed=1, max_batch=2, sync_every=4, overlap="always"))
    prompt = eng.tokenizer.encode("one")
    said = eng.generate([prompt], SamplingParams(temperature=0, max_new_tokens=9))[0].text
    stopping = SamplingParams(temperature=0, max_new_tokens=9, stop=[said[2:4]])  # at its 4th token
    eng.wait_idle(30)
    take_window = eng._take_window

    def slowly(*args):
        time.sleep(0.2)
        take_window(*args)

    eng._take_window = slowly
    for _ in range(3):
        before = (eng.stats.batches, eng.stats.late_rows)
        assert eng.submit(prompt, stopping).result(30).finish == "stop"
        eng.wait_idle(30)
        assert eng._pending is None and (eng.stats.batches - before[0], eng.stats.late_rows - before[1]) == (2, 4)
    eng.use_overlap(False)  # in step from here on: the stop is seen at its window's read, and no window follows
    before = (eng.stats.batches, eng.stats.late_rows)
    assert eng.submit(prompt, stopping).result(30).finish == "stop"
    eng.wait_idle(30)
    assert (eng.stats.batches - before[0], eng.stats.late_rows - before[1]) == (1, 0)
    eng.close()


def test_overlapped_a_request_gives_its_slot_back_once_its_whole_budget_is_queued():
    """The device has been asked for all of a request's tokens: its slot goes to the next request before they are
    read, so requests that end at their budget take as many windows overlapped as in step, with no late rows; and
    what one leaves in its slot is still reused by its next turn when the slot stayed free."""
    def play(overlap: str):
        eng = HFEngine(TINY, EngineConfig(seed=2, max_batch=1, sync_every=4, overlap=overlap))
        tok = eng.tokenizer
        greedy = SamplingParams(temperature=0, max_new_tokens=5, min_new_tokens=5)
        prompts = [tok.encode(f"request number {i} of three, long enough to reuse") for i in range(3)]
        eng.pause()  # all three queued for the one slot
        futures = [eng.submit(p, greedy) for p in prompts]
        eng.resume()
        gens = [f.result(30) for f in futures]
        later = prompts[2] + gens[2].token_ids + tok.encode(" then more")
        gens.append(eng.generate([later], greedy)[0])
        eng.wait_idle(30)
        stats = eng.stats
        eng.close()
        return [g.token_ids for g in gens], (stats.batches, stats.late_rows, stats.prefix_reused_tokens)

    in_step, overlapped = play("never"), play("always")
    assert overlapped == in_step, (overlapped, in_step)
    assert in_step[1][0] == 4 and in_step[1][1] == 0 and in_step[1][2] > 0


def test_overlapped_a_slot_taken_again_before_its_last_requests_tokens_are_read_is_not_reused_as_that_ones():
    """Overlapped, a request that gave its slot back early is read after the next request took the slot. If that next
    one ended at once (its budget its first token) and left the slot free again, the slot now holds the next one's
    columns, not the first's: a later turn of the first request must not reuse them. Its log-probs equal those of an
    engine that prefills it whole."""
    greedy = SamplingParams(temperature=0, max_new_tokens=2, min_new_tokens=2)
    fresh = HFEngine(TINY, EngineConfig(seed=2, prefix_reuse=False))
    tok = fresh.tokenizer
    first = tok.encode("the first request's prompt, long enough to be reused")
    other = tok.encode("another prompt of about the same length, written over")
    later = first + fresh.generate([first], greedy)[0].token_ids + tok.encode(" and its next turn")
    want = fresh.generate([later], greedy)[0]
    fresh.close()
    eng = HFEngine(TINY, EngineConfig(seed=2, max_batch=1, overlap="always"))
    eng.pause()  # one slot: the first takes it; the other takes it when the first gives it back; then the later turn
    futures = [eng.submit(first, greedy), eng.submit(other, SamplingParams(temperature=0, max_new_tokens=1)),
               eng.submit(later, greedy)]
    eng.resume()
    got = [f.result(30) for f in futures][2]
    eng.close()
    assert got.token_ids == want.token_ids
    assert np.allclose(got.logprobs, want.logprobs, atol=1e-5), (got.logprobs, want.logprobs)


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_weights_stay_staged_until_copied_in_and_a_bad_update_is_dropped_once_it_failed(overlap):
    """``has_staged`` says yes until every copy of a swap is queued: a round may reuse its buffers once it says no
    (on a GPU the copies may still be queued behind a window then, and that round's writes queue after them). An
    update naming a parameter the model lacks fails the window it lands in, is dropped, and the engine serves on."""
    eng = HFEngine(TINY, EngineConfig(seed=0, max_batch=2, overlap=overlap))
    prompt = eng.tokenizer.encode("swap")
    newer = dict(build_model(ModelConfig(**{**TINY.__dict__, "init_seed": 5}), eng.tokenizer.vocab_size)
                 .named_parameters())
    staged_while_copying = []

    class Watched:  # a staged tensor that notes whether the weights were still staged as it was copied in
        def __init__(self, tensor):
            self.tensor = tensor

        def to(self, *args):
            staged_while_copying.append(eng.has_staged())
            return self.tensor.to(*args)

    eng.load_weights({name: Watched(t) for name, t in newer.items()}, 3)
    assert set(eng.generate([prompt], SamplingParams(max_new_tokens=4))[0].versions) == {3}
    assert len(staged_while_copying) == len(newer) and all(staged_while_copying) and not eng.has_staged()
    eng.load_weights({"no.such.weight": torch.zeros(1)}, 4)
    g = eng.submit(prompt, SamplingParams(max_new_tokens=4))
    assert set(g.result(30).versions) == {3} and not eng.has_staged(), "the bad update was dropped"
    eng.close()


def test_requests_that_cannot_fit_are_refused_clearly_and_the_engine_serves_on():
    eng = HFEngine(TINY, EngineConfig(seed=0, max_batch=2, max_seq_len=64))
    tok = eng.tokenizer
    with pytest.raises(ValueError, match="max_seq_len=64"):
        eng.submit(tok.encode("x" * 60), SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.submit([], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        eng.submit([1], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="vision-language"):
        eng.submit([1], SamplingParams(), images=[object()])
    assert len(eng.generate([tok.encode("ok")], SamplingParams(max_new_tokens=5))[0].token_ids) > 0
    eng.close()


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_a_failing_step_fails_its_requests_and_the_next_ones_are_served(monkeypatch, overlap):
    eng = HFEngine(TINY, EngineConfig(seed=0, max_batch=4, overlap=overlap))
    tok = eng.tokenizer
    real = eng.step
    calls = {"n": 0}

    def broken(rows, columns):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real(rows, columns)

    monkeypatch.setattr(eng, "step", broken)
    eng.pause()  # all three in the batch the failing step holds, whatever the threads' timing
    futures = [eng.submit(tok.encode(f"p{i}"), SamplingParams(max_new_tokens=20, min_new_tokens=20)) for i in range(3)]
    eng.resume()
    for f in futures:
        with pytest.raises(RuntimeError, match="device lost"):
            f.result(30)
    assert sorted(eng.free_slots) == [0, 1, 2, 3], "their slots came back"
    g = eng.generate([tok.encode("again")], SamplingParams(max_new_tokens=6, min_new_tokens=6))[0]
    assert len(g.token_ids) == 6
    eng.close()


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_without_interrupt_staged_weights_wait_until_nothing_runs(overlap):
    eng = HFEngine(TINY, EngineConfig(seed=0, max_batch=2, interrupt=False, overlap=overlap))
    tok = eng.tokenizer
    newer = dict(build_model(ModelConfig(**{**TINY.__dict__, "init_seed": 9}), tok.vocab_size).named_parameters())
    staged = threading.Event()

    def hook():
        if not staged.is_set():
            eng.load_weights(newer, 4)
            staged.set()

    eng.step_hook = hook
    running = eng.submit(tok.encode("first"), SamplingParams(max_new_tokens=30, min_new_tokens=30))
    staged.wait(30)
    queued = eng.submit(tok.encode("second"), SamplingParams(max_new_tokens=5))
    g1, g2 = running.result(30), queued.result(30)
    assert set(g1.versions) == {0}, "the running request finished on the weights it started with"
    assert set(g2.versions) == {4}, "the waiting one started after the swap"
    eng.close()


def test_decode_attention_reads_grouped_heads_once_and_equals_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, cols, dim = 5, 8, 2, 37, 16
    q = torch.randn(rows, heads, 1, dim, generator=g)
    k, v = torch.randn(rows, kv_heads, cols, dim, generator=g), torch.randn(rows, kv_heads, cols, dim, generator=g)
    lengths = torch.tensor([1, 5, 17, 36, 37])
    mask = (torch.arange(cols)[None, :] < lengths[:, None])[:, None, None, :]
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # what the engine passes
    module = type("M", (), {"num_key_value_groups": heads // kv_heads, "is_causal": True})()
    ours, _ = slot_decode_attention(module, q, k, v, additive, scaling=dim ** -0.5)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    eng = HFEngine(TINY, EngineConfig())
    assert eng.slot_attention, "the engine's own model decodes with it"
    eng.close()


def test_every_layer_of_a_pass_gets_one_additive_mask_built_once_with_aligned_rows(monkeypatch):
    """A boolean mask is converted to an additive one by SDPA in every layer (our decode attention did the same):
    the engine gives every layer of a pass one additive mask in the attention's dtype, whose rows lie 8 elements
    apart in memory (what the memory-efficient kernel of a masked SDPA on a GPU needs, or it copies the mask in
    every layer). A pass whose prompts all start at column 0 gets no mask: causal attention over its own tokens is
    exact for them. Seen by every layer of every prefill pass and decode step, and the log-probs unchanged."""
    import actor.slot_attention as slot_attention

    passes: list[list] = []
    attend = slot_attention.slot_decode_attention

    def seen(module, query, key, value, attention_mask, **kw):
        if threading.current_thread().name.startswith("hf-engine"):  # (not the teacher-forced passes below)
            if module.layer_idx == 0:
                passes.append([])
            passes[-1].append((query.shape[2], key.shape[2], attention_mask))
        return attend(module, query, key, value, attention_mask, **kw)

    monkeypatch.setattr(slot_attention, "slot_decode_attention", seen)
    eng = HFEngine(TINY, EngineConfig(seed=4, max_batch=4, sync_every=3, prefill_tokens=40))
    tok = eng.tokenizer
    prompts = [tok.encode("go " * n) for n in (1, 4, 9, 30)]  # the longest prefilled in two chunks
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=7))
    _agree(eng, prompts, gens)
    layers = eng.model.config.num_hidden_layers
    assert {len(p) for p in passes} == {layers} and any(q > 1 for q, _, _ in (p[0] for p in passes)), \
        "prefill passes and decode steps were seen"
    causal = [p for p in passes if p[0][2] is None]
    assert causal and all(q > 1 and q == k for q, k, _ in causal[0]), \
        "the first pass's prompts start at column 0: causal over its own tokens, no mask"
    assert any(q > 1 and m is not None for q, _, m in (p[0] for p in passes)), "a later chunk's pass has a mask"
    for p in passes:
        mask = p[0][2]
        assert all(m is mask for _, _, m in p), "one mask for every layer of the pass"
        if mask is None:
            continue
        queries, columns = p[0][0], p[0][1]
        assert mask.dtype == next(eng.model.parameters()).dtype and mask.shape[-2:] == (queries, columns)
        assert set(mask.unique().tolist()) <= {0.0, torch.finfo(mask.dtype).min} and (mask == 0).any(-1).all()
        assert mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1]), mask.stride()
    eng.close()


def test_the_cache_is_sized_for_the_longest_turn_the_prompt_settings_allow():
    from actor.config import ActorConfig
    from actor.prompt import PromptConfig

    assert EngineConfig().fitted(512, 48).max_seq_len == 560
    assert EngineConfig(max_seq_len=1000).fitted(512, 48).max_seq_len == 1000
    with pytest.raises(ValueError, match="max_seq_len 500 cannot hold a turn"):
        ActorConfig(engine=EngineConfig(max_seq_len=500), prompt=PromptConfig(max_prompt_tokens=512)).validate()


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_a_row_past_its_budget_writes_no_column_beyond_its_slots_last(overlap):
    """A window runs its whole length for every row, so a row whose budget ends inside it decodes past it. Its cache
    position must stay at its last column: in a slot with no spare column (``max_seq_len`` 95: 96 columns, the last
    one scratch) a prompt of 70 tokens with 18 new ones takes two windows of 16, and a row that kept advancing would
    write 6 columns past the cache's end (on a GPU, into whatever memory follows)."""
    eng = HFEngine(TINY, EngineConfig(seed=3, max_batch=2, sync_every=16, max_seq_len=95, overlap=overlap))
    roomy = HFEngine(TINY, EngineConfig(seed=3, max_batch=2, sync_every=1))
    assert eng.cache.keys[0].shape[2] == 96
    prompts = [eng.tokenizer.encode("x" * 70), eng.tokenizer.encode("y" * 40)]
    params = SamplingParams(max_new_tokens=18, min_new_tokens=18, temperature=0)
    gens, alone = eng.generate(prompts, params), roomy.generate(prompts, params)
    assert [len(g.token_ids) for g in gens] == [18, 18]
    for g, a in zip(gens, alone):
        assert g.token_ids == a.token_ids
        np.testing.assert_allclose(g.logprobs, a.logprobs, atol=3e-5)
    eng.close()
    roomy.close()


def test_a_dead_engine_thread_fails_its_requests_and_refuses_new_ones(monkeypatch):
    eng = HFEngine(TINY, EngineConfig(seed=0))

    def broken(*_):
        raise RuntimeError("no such device")

    monkeypatch.setattr(eng, "_serve_windows", broken)  # e.g. a GPU the thread cannot select
    f = eng.submit([1, 2, 3], SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="no such device"):
        f.result(10)
    with pytest.raises(RuntimeError, match="thread died of RuntimeError"):
        eng.submit([1, 2, 3], SamplingParams(max_new_tokens=4))


@pytest.mark.slow  # inductor compiles the step and the prefill pass (C++ on a CPU): about a minute
def test_compiled_passes_serve_every_shape_with_one_compilation_each_and_see_swaps_in_place():
    """``compile``: the step and the prefill pass inductor compiled give the eager engine's log-probs over passes of
    every kind (one row or several, one token or many, chunks of a long prompt, prefixes copied or left in a
    slot) without compiling again per shape, and read weights swapped in place (the GPU's captured graphs replay
    this same compiled step)."""
    from torch._dynamo.utils import counters

    counters.clear()
    one_layer = ModelConfig(**{**TINY.__dict__, "num_layers": 1})  # what is compiled matters less than how often
    eng = HFEngine(one_layer, EngineConfig(seed=2, max_batch=4, sync_every=3, compile=True, prefill_tokens=24))
    tok = eng.tokenizer
    prompts = [tok.encode("go " * (1 + 5 * (i % 3)) + str(i)) for i in range(7)]
    prompts.append(tok.encode("a" * 25))  # 24 tokens, then a pass of one token from column 24 on
    gens = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10))
    assert not (eng.compiled_step.disabled or eng.compiled_prefill.disabled), \
        (eng.compiled_step.disabled, eng.compiled_prefill.disabled)
    _agree(eng, prompts, gens)
    graphs = counters["stats"]["unique_graphs"]
    # the prefill pass once per kind (prompts from column 0, causal; the rest under a mask); the step once, and once
    # more for a batch of one row (windows are not padded)
    assert 3 <= graphs <= 4, graphs
    assert eng.stats.prefill_batches > 4 and eng.stats.prefix_reused_tokens > 0
    # later turns of the same episodes: what a slot still holds is not prefilled again
    turns = [p + g.token_ids + tok.encode(" ok") for p, g in zip(prompts, gens)]
    later = eng.generate(turns, SamplingParams(temperature=1.0, max_new_tokens=6))
    _agree(eng, turns, later)
    assert counters["stats"]["unique_graphs"] == graphs, "no shape compiled again"
    newer = build_model(ModelConfig(**{**one_layer.__dict__, "init_seed": 7}), tok.vocab_size)
    eng.load_weights(dict(newer.named_parameters()), 1)
    after = eng.generate(prompts[:3], SamplingParams(temperature=1.0, max_new_tokens=8))
    assert {v for g in after for v in g.versions} == {1}
    _agree(eng, prompts[:3], after)
    eng.close()


@pytest.mark.slow  # a process of its own (no backward may have run in it yet), and a compilation: about 10 s
def test_a_process_that_compiled_on_another_thread_still_trains():
    """An engine's passes compile on the engine's own thread; a learner in the same process (the in-process tier, a
    test session) then runs its first backward. torch 2.11, the lent GPU machines' version, segfaulted there (in
    autograd's ``Engine::start_device_threads``) unless autograd had started its threads before anything compiled,
    which ``Compiled`` now sees to (``actor/compiled.py``). Our pinned torch does not segfault either way, so this
    fails only where that torch runs: ``launch/gpu-rehearsal.sh`` runs it under torch 2.11 (without the fix: -11)."""
    import subprocess
    import sys

    script = """
import threading
import torch
from actor.compiled import Compiled
double_silu = Compiled(lambda x: torch.nn.functional.silu(x) * 2, "a pass")
def serve():
    with torch.no_grad():
        for rows in (3, 5):
            double_silu(torch.randn(rows, 4))
engine = threading.Thread(target=serve)
engine.start()
engine.join()
assert not double_silu.disabled, double_silu.disabled
model = torch.nn.Linear(4, 1)
model(torch.randn(2, 4)).sum().backward()
print("trained", float(model.weight.grad.abs().sum()) > 0)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=str(REPO),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "trained True" in done.stdout, (done.returncode, done.stderr[-3000:])


def test_a_pass_that_cannot_be_compiled_runs_eagerly():
    from actor.compiled import Compiled

    step = Compiled(lambda rows, columns: rows * columns, "the decode step")

    def refuse(rows, columns):
        raise RuntimeError("no C++ compiler")

    step.compiled = refuse
    assert step(3, 4) == 12 and "no C++ compiler" in step.disabled
    assert step(2, 5) == 10, "the eager step from then on"


def test_engine_figures_cover_what_happened_since_and_say_none_for_a_phase_no_clock_timed():
    """``EngineStats.since`` subtracts an earlier copy (first-token times: the ones since, none once the deque has
    wrapped); ``figures`` derives the phases, and says None for a phase an engine keeps no clock for."""
    import copy

    from actor.engine import EngineStats

    st = EngineStats(seconds=1.0, prefill_seconds=0.25, decode_steps=10, decode_rows=40, prefill_batches=2,
                     prompt_tokens=300, prefix_reused_tokens=100, batches=5)
    st.first_token_s.extend([0.1, 0.2])
    before = copy.deepcopy(st)
    st.seconds, st.prefill_seconds, st.decode_steps, st.decode_rows, st.late_rows = 3.0, 1.25, 20, 120, 20
    st.prefill_batches, st.prompt_tokens, st.batches = 4, 700, 7
    st.first_token_s.append(0.3)
    run = st.since(before)
    assert (run.seconds, run.decode_steps, run.batches, list(run.first_token_s)) == (2.0, 10, 2, [0.3])
    assert run.figures() == {"mean_batch": 8.0, "late_row_share": 0.2, "prefill_share": 0.5,
                             "decode_ms_per_step": 100.0, "prefill_ms_per_pass": 500.0, "prompt_tokens_per_pass": 200.0,
                             "prefix_reused_share": 0.0}
    st.first_token_s.extend([1.0] * st.first_token_s.maxlen)
    assert not st.since(before).first_token_s, "a wrapped deque cannot say which times are new"
    # the vllm engine times its busy seconds only: no prefill share, no per-pass or per-step figures
    timed = EngineStats(seconds=2.0, generated_tokens=50, prompt_tokens=80).figures()
    assert timed["prefill_share"] is timed["decode_ms_per_step"] is timed["prefill_ms_per_pass"] is None
