"""The GPU paths on a real GPU (skipped without one): bf16 compute on float32 masters, the HF engine's
log-probs against the learner's scoring, a padded vocabulary, and a weight round between two processes that
share one GPU (the backend agreement picks CUDA IPC: NCCL refuses two ranks on a device), and behaviour cloning
on the GPU (``pretrain.device``)."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no GPU visible", allow_module_level=True)

from actor.engine import EngineConfig, SamplingParams  # noqa: E402
from actor.hf_engine import HFEngine  # noqa: E402
from policy.model import ModelConfig, sequence_logprobs  # noqa: E402
from common.net import free_port  # noqa: E402
from policy.weightsync import WeightReceiver, WeightSender, WeightSyncConfig, tensor_home  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from tests.conftest import stage_weights_before_window  # noqa: E402
from tests.test_learner import groups_from  # noqa: E402

# vocab_size 512 > the byte tokenizer's: padding rows that must never be sampled or scored
SMALL = ModelConfig(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512)


def test_learner_on_cuda_trains_bf16_on_float32_masters():
    t = Trainer(LearnerConfig(device="cuda", lr=1e-4), SMALL)
    assert t.compute_dtype == torch.bfloat16 and next(t.model.parameters()).dtype == torch.float32
    assert t.model.get_input_embeddings().num_embeddings == 512 > t.tokenizer.vocab_size
    for i in range(3):
        m = t.train_step(groups_from(t, seed=i, version=t.version))
        assert m is not None and np.isfinite(m["loss"]) and m["grad_norm"] > 0
    named = t.weights_for_broadcast()
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for _, p in named)


def test_a_learner_step_host_waits_per_update_not_per_micro_batch_on_cuda():
    """torch's sync debug mode warns at every call that makes the host wait for the GPU. A step's waits, past the
    copies of its collated micro-batches to the GPU (all made before its first pass), do not grow with its
    micro-batches: 2 or 8 of them, the same waits at the same places, with a reference model (the KL term) and two
    updates a step (pi_prox recomputed)."""
    import dataclasses
    import warnings

    from learner.losses import LossConfig

    cfg = LearnerConfig(device="cuda", lr=1e-4, updates_per_batch=2, prox="recompute", loss=LossConfig(kl_beta=0.1))
    counted = {}
    for mb_tokens in (160, 40):
        t = Trainer(dataclasses.replace(cfg, micro_batch_tokens=mb_tokens), SMALL, seed=0)
        t.train_step(groups_from(t, seed=0, good=b"ok()", bad=b"fail(again)"))
        groups = groups_from(t, seed=1, version=t.version, good=b"ok()", bad=b"fail(again)")
        # a group whose rollouts share their prompt: its passes run it once (share_prompts), on the GPU too
        groups += groups_from(t, n_groups=1, seed=2, version=t.version, good=b"ok()", bad=b"fail(again)",
                              same_prompt=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                m = t.train_step(groups)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert m["prompt_tokens_shared"] > 0
        sites: dict[tuple[str, int], int] = {}
        for w in caught:
            if "synchroniz" in str(w.message) and not w.filename.endswith("learner/batch.py"):
                sites[(w.filename, w.lineno)] = sites.get((w.filename, w.lineno), 0) + 1
        counted[m["micro_batches"]] = sites
    (few, at_few), (many, at_many) = sorted(counted.items())
    assert 2 <= few < many, (few, many)
    assert at_few == at_many, f"waits that grow with micro-batches: {at_few} against {at_many}"
    assert sum(at_many.values()) <= 12, at_many


def test_engine_on_cuda_samples_only_real_tokens_with_the_learners_logprobs():
    eng = HFEngine(SMALL, EngineConfig(device="cuda", seed=1))
    prompt = list(b"click the button ")
    gens = eng.generate([prompt] * 8, SamplingParams(temperature=1.0, max_new_tokens=24))
    vocab = eng.tokenizer.vocab_size
    for g in gens:
        assert all(0 <= t < vocab for t in g.token_ids), "a padding row of the embedding was sampled"
        seq = torch.tensor([prompt + g.token_ids], device="cuda")
        with torch.no_grad():
            ref = sequence_logprobs(eng.model, seq, vocab=vocab)[0, len(prompt) - 1:].float().cpu().numpy()
        # bf16 decode with a KV cache vs one teacher-forced pass: equal up to bf16 rounding
        assert np.allclose(np.array(g.logprobs), ref, atol=0.15), (g.logprobs[:5], ref[:5])


F32 = ModelConfig(**{**SMALL.__dict__, "dtype": "float32"})


def _teacher_forced(model, prompt, gen, vocab):
    seq = torch.tensor([prompt + gen.token_ids], device="cuda")
    with torch.no_grad():
        return sequence_logprobs(model, seq, vocab=vocab)[0, len(prompt) - 1:].float().cpu().numpy()


def test_engine_graphs_continuous_batching_and_in_place_swaps_on_cuda():
    """Captured decode graphs over slots joining and leaving (prompts of many lengths, more requests than slots,
    windows of 8 tokens): every token's log-prob equals a teacher-forced pass; after a swap staged mid-decode,
    the graphs read the new parameters (checked against an independent build of the new weights)."""
    from policy.model import build_model

    eng = HFEngine(F32, EngineConfig(device="cuda", seed=1, max_batch=8, max_seq_len=512, sync_every=8))
    assert eng.graphs is not None
    vocab = eng.tokenizer.vocab_size
    prompts = [list(f"click the button number {i} ".encode() * (1 + i % 5)) for i in range(20)]
    gens = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=40))
    assert eng.graphs.graphs and not eng.graphs.disabled, eng.graphs.disabled
    assert eng.stats.decode_rows / eng.stats.decode_steps > 4, "requests decode together"
    for p, g in zip(prompts, gens):
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) > 0
        assert np.allclose(np.array(g.logprobs), _teacher_forced(eng.model, p, g, vocab), atol=2e-3)
    newer = build_model(ModelConfig(**{**F32.__dict__, "init_seed": 99}), vocab, "cuda").eval()
    stage_weights_before_window(eng, 2, dict(newer.named_parameters()), 7)
    mid = eng.generate([prompts[0]], SamplingParams(temperature=1.0, max_new_tokens=40))[0]
    eng.step_hook = None
    assert mid.versions[0] == 0 and mid.versions[-1] == 7 and sorted(mid.versions) == mid.versions
    after = eng.generate(prompts[:4], SamplingParams(temperature=1.0, max_new_tokens=24))
    for p, g in zip(prompts, after):
        assert set(g.versions) == {7}
        assert np.allclose(np.array(g.logprobs), _teacher_forced(newer, p, g, vocab), atol=2e-3)
    greedy = eng.generate(prompts[:3], SamplingParams(temperature=0, max_new_tokens=16))
    eager = HFEngine(F32, EngineConfig(device="cuda", seed=1, max_batch=8, max_seq_len=512, cuda_graphs=False))
    eager.load_weights(dict(newer.named_parameters()), 7)
    assert [g.token_ids for g in eager.generate(prompts[:3], SamplingParams(temperature=0, max_new_tokens=16))] \
        == [g.token_ids for g in greedy], "graphs and eager decode agree greedily"
    eng.close()
    eager.close()


def test_a_compiled_step_captured_as_graphs_agrees_and_sees_swaps_on_cuda():
    """``compile`` on a GPU: graphs capture the step inductor compiled (one compilation for every bucket), and the
    prefill passes run compiled; every token's log-prob equals a teacher-forced pass, before and after weights are
    swapped in place."""
    from policy.model import build_model

    eng = HFEngine(F32, EngineConfig(device="cuda", seed=1, max_batch=8, max_seq_len=512, sync_every=8, compile=True))
    vocab = eng.tokenizer.vocab_size
    prompts = [list(f"click the button number {i} ".encode() * (1 + i % 5)) for i in range(12)]
    gens = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=40))
    assert not (eng.compiled_step.disabled or eng.compiled_prefill.disabled) and eng.graphs.graphs \
        and not eng.graphs.disabled, (eng.compiled_step.disabled, eng.compiled_prefill.disabled, eng.graphs.disabled)
    for p, g in zip(prompts, gens):
        assert np.allclose(np.array(g.logprobs), _teacher_forced(eng.model, p, g, vocab), atol=2e-3)
    newer = build_model(ModelConfig(**{**F32.__dict__, "init_seed": 99}), vocab, "cuda").eval()
    eng.load_weights(dict(newer.named_parameters()), 3)
    after = eng.generate(prompts[:4], SamplingParams(temperature=1.0, max_new_tokens=24))
    for p, g in zip(prompts, after):
        assert set(g.versions) == {3}
        assert np.allclose(np.array(g.logprobs), _teacher_forced(newer, p, g, vocab), atol=2e-3)
    eng.close()


def _event_waits(monkeypatch) -> dict:
    """Counts of ``torch.cuda.Event.synchronize`` calls on the engine's thread (sync debug mode does not flag an
    event's wait: an overlapped engine's one wait per window is counted here)."""
    import threading

    waits = {"n": 0}
    synchronize = torch.cuda.Event.synchronize

    def counted(self):
        if threading.current_thread().name.startswith("hf-engine"):
            waits["n"] += 1
        return synchronize(self)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    return waits


@pytest.mark.parametrize("overlap", ["never", "always"])
def test_the_host_waits_for_the_gpu_only_at_a_windows_read_and_an_admissions_read_on_cuda(monkeypatch, overlap):
    """torch's sync debug mode warns at every call that makes the host wait for the GPU. In a run whose prompts are
    all queued at once (one admission of several prefill passes: short prompts, a chunked one, a group's twins and a
    copy), the host waits only where the engine reads on purpose: in step, once per window and once per admission;
    overlapped, once per window at an event recorded behind its copies (which the debug mode does not flag: counted
    apart). A wait anywhere else (a copy from pageable memory, a hidden ``item``) is named by its file and line. A
    first run of the same shapes captures the window graphs; should the measured run still capture one, the
    capture's own waits (in torch.cuda) are let through."""
    import warnings

    waits = _event_waits(monkeypatch)
    eng = HFEngine(F32, EngineConfig(device="cuda", seed=2, max_batch=8, max_seq_len=512, sync_every=8,
                                     prefill_tokens=64, overlap=overlap))
    greedy = SamplingParams(temperature=0, max_new_tokens=24)

    def run(word: bytes):
        group = word + b" is the prompt the rollouts of one group share, whole "
        prompts = [list(word + b" " + b"go " * (1 + 9 * i)) for i in range(4)] + [list(group)] * 3 \
            + [list(group + b"and more")]
        eng.pause()  # all queued: the first window admits every one
        futures = [eng.submit(p, greedy) for p in prompts]
        before = (eng.stats.prefill_batches, eng.stats.batches, eng.stats.prefix_copies, len(eng.graphs.graphs))
        eng.resume()
        for f in futures:
            f.result(timeout=120)
        eng.wait_idle()  # (overlapped: the last window is read after the requests resolved)
        after = (eng.stats.prefill_batches, eng.stats.batches, eng.stats.prefix_copies, len(eng.graphs.graphs))
        return [a - b for a, b in zip(after, before)]

    run(b"first")
    assert eng.graphs.graphs and not eng.graphs.disabled, eng.graphs.disabled
    waits["n"] = 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            passes, windows, copies, captured = run(b"other")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sites: dict[tuple[str, int], int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[(w.filename, w.lineno)] = sites.get((w.filename, w.lineno), 0) + 1
    reads = {site: n for site, n in sites.items() if site[0].endswith("actor/hf_engine.py")}
    others = {site: n for site, n in sites.items()
              if site not in reads and not (captured and "torch/cuda/" in site[0])}
    assert not others, f"waits outside the engine's two reads: {others}"
    assert passes >= 3 and copies >= 3, (passes, copies)
    if overlap == "never":
        assert sorted(reads.values()) == sorted([1, windows]), (passes, windows, reads)
        assert waits["n"] == 0
    else:
        assert not reads and waits["n"] == windows, (windows, reads, waits)
        assert eng.stats.late_rows > 0
    eng.close()


def test_a_vlm_admission_host_waits_in_our_code_only_at_its_reads_on_cuda(tmp_path):
    """A VLM's image inputs and multimodal positions are worked out on the host and go to the GPU from pinned memory
    (``policy/vision.py: model_inputs``), so in an admission of screenshot prompts (a twin among them) nothing of ours
    makes the host wait for the GPU but the admission's one read and the windows' reads (in step: overlapped reads
    wait at events, which the debug mode does not flag). transformers' vision tower still reads its grids from the
    device (its waits are in its own files, let through here)."""
    import warnings

    from actor.prompt import EpisodePrompt, PromptConfig
    from env_server.sim.backend import SimBackend, SimConfig
    from launch.tiny_checkpoints import vlm_checkpoint

    cfg = ModelConfig(path=str(vlm_checkpoint(tmp_path / "vlm", corpus_episodes=20)), dtype="float32")
    eng = HFEngine(cfg, EngineConfig(device="cuda", seed=1, max_batch=8, sync_every=8, overlap="never"))
    tok = eng.tokenizer
    greedy = SamplingParams(temperature=0, max_new_tokens=16)

    def run(first: int):
        prompts, images = [], []
        for seed in range(first, first + 3):
            obs = SimBackend(SimConfig(screenshot="png")).reset(f"sim:train:screen_click_marker/{seed}")
            prompt = EpisodePrompt(tok, PromptConfig(style="minimal", observation="screenshot"), obs["instruction"])
            prompts.append(prompt.build(obs))
            images.append(prompt.images)
        prompts.insert(1, prompts[0])
        images.insert(1, images[0])
        eng.pause()
        futures = [eng.submit(p, greedy, imgs) for p, imgs in zip(prompts, images)]
        eng.resume()
        for f in futures:
            f.result(timeout=120)

    run(100)  # captures the window graphs
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(200)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ours = {}
    for w in caught:
        if "synchroniz" in str(w.message) and "/transformers/" not in w.filename and "torch/cuda/" not in w.filename:
            ours[(w.filename, w.lineno)] = ours.get((w.filename, w.lineno), 0) + 1
    # the admission's read and the windows' read: two lines of the engine (none at all would mean nothing was seen)
    assert len(ours) == 2 and all(site[0].endswith("actor/hf_engine.py") for site in ours), ours
    assert eng.stats.prefix_copies >= 1
    eng.close()


def test_a_window_graph_samples_inside_it_from_the_engines_generator_on_cuda():
    """A whole window (8 steps and their sampling) is one graph replay, the engine's generator registered with every
    graph: engines seeded alike draw the same tokens, engines seeded apart do not, and every replay moves the
    generator on by its own draws (8 exponential races a window, each at least 4 philox offsets)."""
    prompts = [list(f"open the file number {i} ".encode() * (1 + i % 3)) for i in range(6)]

    def run(seed: int):
        eng = HFEngine(F32, EngineConfig(device="cuda", seed=seed, max_batch=8, max_seq_len=512, sync_every=8))
        start = eng.gen.get_offset()
        eng.pause()  # every prompt queued before the first window: the windows' batches do not depend on timing
        futures = [eng.submit(p, SamplingParams(temperature=1.0, max_new_tokens=40)) for p in prompts]
        eng.resume()
        gens = [f.result(timeout=120) for f in futures]
        assert eng.graphs.graphs and not eng.graphs.disabled, eng.graphs.disabled
        moved, windows = eng.gen.get_offset() - start, eng.stats.batches
        eng.close()
        return [g.token_ids for g in gens], moved, windows

    a, moved, windows = run(5)
    assert run(5)[0] == a, "the same seed draws the same tokens: a replay reads the generator where it stands"
    assert run(6)[0] != a
    assert windows >= 5 and moved >= 8 * 4 * windows, (moved, windows)


def test_a_vlm_decodes_through_window_graphs_on_cuda(tmp_path):
    """A VLM's decode windows are captured and replayed as a text model's are (its multimodal rotary positions are one
    more fixed tensor a window advances): screenshots in the prompts, more requests than slots so rows join and leave
    between replays, a twin (the first prompt again, with its screenshot: its columns and positions are copied), and
    every token and log-prob equal to eager decoding of the same model."""
    from actor.prompt import EpisodePrompt, PromptConfig
    from env_server.sim.backend import SimBackend, SimConfig
    from launch.tiny_checkpoints import vlm_checkpoint

    cfg = ModelConfig(path=str(vlm_checkpoint(tmp_path / "vlm", corpus_episodes=20)), dtype="float32")
    engines = [HFEngine(cfg, EngineConfig(device="cuda", seed=1, max_batch=4, sync_every=8, cuda_graphs=graphs))
               for graphs in (True, False)]
    tok = engines[0].tokenizer
    prompts, images = [], []
    for i, task in enumerate(["files_delete/1", "files_delete/2", "sheet_sort/3", "settings_display/4", "sheet_sort/5",
                                "files_delete/6"]):
        obs = SimBackend(SimConfig(screenshot="png")).reset(f"sim:train:{task}")
        prompt = EpisodePrompt(tok, PromptConfig(style="minimal", observation="both" if i % 2 else "screenshot"),
                               obs["instruction"])
        prompts.append(prompt.build(obs))
        images.append(prompt.images)
    prompts.insert(1, prompts[0])
    images.insert(1, images[0])
    params = SamplingParams(temperature=0, max_new_tokens=32, min_new_tokens=16)

    def play(eng):
        eng.pause()  # every request waiting before the first admission: the twin is admitted with its source
        futures = [eng.submit(p, params, imgs) for p, imgs in zip(prompts, images)]
        eng.resume()
        return [f.result(120) for f in futures]

    captured, eager = (play(eng) for eng in engines)
    assert all(eng.stats.prefix_copies == 1 for eng in engines), "the twin took its source's columns"
    assert engines[0].graphs.graphs and not engines[0].graphs.disabled, engines[0].graphs.disabled
    assert engines[1].graphs is None
    for a, b in zip(captured, eager):
        assert a.token_ids == b.token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
    for eng in engines:
        eng.close()


def _receive(port: int, q) -> None:
    cfg = WeightSyncConfig(port=port, join_window_s=20.0, timeout_s=60.0, bucket_mb=1.0)
    like = [("w", torch.empty(1000, 1000, device="cuda")), ("b", torch.empty(1000, device="cuda")),
            ("c", torch.empty(10, device="cuda"))]
    rx = WeightReceiver(cfg, None)
    for r in (1, 2):
        version, tensors = rx.receive(r, 1, like)
        q.put((version, {n: t.float().cpu() for n, t in tensors.items()}, str(tensors["w"].dtype), tensor_home("cuda")))


@pytest.mark.parametrize("backend,expected", [("auto", "cuda_ipc"), ("gloo", "gloo")])
def test_a_round_between_two_processes_on_one_gpu(quiet_log, backend, expected):
    """Learner and engine on one GPU: auto agrees on CUDA IPC (NCCL refuses two ranks on a device), gloo when
    asked; two rounds on one epoch, a 2 MB tensor in a bucket of its own and two small ones packed."""
    port = free_port()
    sender = WeightSender(WeightSyncConfig(port=port, join_window_s=20.0, timeout_s=60.0, bucket_mb=1.0,
                                           backend=backend), quiet_log)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receive, args=(port, q), daemon=True)
    p.start()
    base = torch.cuda.memory_allocated()
    for version in (3, 4):
        r, e = sender.open_round()
        assert e == 1
        g = torch.Generator(device="cuda").manual_seed(version)
        sent = {"w": torch.randn(1000, 1000, device="cuda", generator=g).bfloat16(),
                "b": torch.randn(1000, device="cuda", generator=g).bfloat16(),
                "c": torch.randn(10, device="cuda", generator=g).bfloat16()}
        assert sender.broadcast(list(sent.items()), version, 1) == 1
        got_version, got, dtype, place = q.get(timeout=120)
        assert got_version == version and dtype == "torch.bfloat16" and place == tensor_home("cuda")
        for n, t in sent.items():
            assert torch.equal(got[n], t.float().cpu()), n
        del sent
        # (a generator keeps a few hundred bytes; one bucket here is 2 MB)
        assert torch.cuda.memory_allocated() - base < 1 << 20, "the round's shared buffers are freed once it closes"
    p.join(30)
    assert sender.backend == expected


def test_pretrain_on_cuda_clones_and_exports_float32_masters(tmp_path):
    import json

    from safetensors import safe_open

    from actor.prompt import PromptConfig
    from common import log as L
    from launch.pretrain import PretrainConfig, pretrain

    log = L.setup("test", "test", 0, None, "warning", quiet=True)
    cfg = PretrainConfig(families=["settings_display"], seeds=40, steps=25, batch_samples=16, lr=6e-3,
                         warmup_steps=2, eval_episodes=4, eval_max_new_tokens=40, device="cuda")
    small = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    losses = []
    out = pretrain(cfg, small, PromptConfig(style="minimal", max_prompt_tokens=768), tmp_path / "base", log,
                   lambda s, n, loss: losses.append(loss))
    assert losses[-1] < losses[0] * 0.7, losses
    with safe_open(str(tmp_path / "base" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}, "the masters, not the bf16 twin"
    assert out["heldout"]["episodes"] == 4, "evaluated on the GPU after cloning"
    assert json.loads((tmp_path / "base" / "state.json").read_text())["pretrain"]["device"] == "cuda"


def test_an_engines_version_0_is_the_learners_compute_copy_on_cuda():
    """Before the first weight round an engine samples from the model it built itself: it must be the learner's
    bf16 compute copy bit for bit, so version-0 tokens carry the learner's log-probs (a run on an H100 once saw a
    mean |delta log p| of 0.34 there, with an init drawn in bf16)."""
    t = Trainer(LearnerConfig(device="cuda"), SMALL)
    eng = HFEngine(SMALL, EngineConfig(device="cuda", seed=3))
    for (n, mine), (_, theirs) in zip(t.net.module.named_parameters(), eng.model.named_parameters()):
        assert mine.dtype == theirs.dtype == torch.bfloat16 and torch.equal(mine.detach(), theirs.detach()), n
    prompt = list(b"click the button ")
    gens = eng.generate([prompt] * 8, SamplingParams(temperature=1.0, max_new_tokens=32))
    vocab = eng.tokenizer.vocab_size
    gaps = []
    for g in gens:
        seq = torch.tensor([prompt + g.token_ids], device="cuda")
        with torch.no_grad():
            ref = sequence_logprobs(t.net.module, seq, vocab=vocab)[0, len(prompt) - 1:].float().cpu().numpy()
        gaps.extend(np.abs(np.array(g.logprobs) - ref))
    print(f"version 0: mean |delta log p| {np.mean(gaps):.5f}, max {np.max(gaps):.5f} over {len(gaps)} tokens")
    assert np.mean(gaps) < 0.02, np.mean(gaps)
    eng.close()
