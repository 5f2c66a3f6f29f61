"""Vision-language policies: screenshots in prompts by content hash, stored once, rebuilt by the learner into the same
model inputs the engine used. The checkpoint is a tiny Qwen2-VL built here (``launch.tiny_checkpoints``)."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from actor.engine import EngineConfig, SamplingParams  # noqa: E402
from actor.hf_engine import HFEngine  # noqa: E402
from actor.episode import EnginePolicy, LocalEnv, play_episode  # noqa: E402
from actor.prompt import EpisodePrompt, PromptConfig  # noqa: E402
from common import protocol as P  # noqa: E402
from policy.model import ModelConfig, model_kind  # noqa: E402
from common.images import Image, ImageStore, ImageStoreError  # noqa: E402
from env_server.sim.backend import SimBackend, SimConfig  # noqa: E402
from launch.tiny_checkpoints import vlm_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return vlm_checkpoint(tmp_path_factory.mktemp("vlm"), corpus_episodes=20)


@pytest.fixture(scope="module")
def engine(vlm_dir):
    return HFEngine(ModelConfig(path=str(vlm_dir)), EngineConfig(seed=1))


def screen(task: str = "sim:train:files_delete/1") -> tuple[SimBackend, dict]:
    backend = SimBackend(SimConfig(screenshot="png"))
    return backend, backend.reset(task)


def test_the_image_store_keeps_each_image_once_and_checks_what_it_reads(tmp_path):
    store = ImageStore(tmp_path / "images")
    img = Image.of(b"\x89PNG fake bytes")
    assert store.put(img) and not store.put(img) and not ImageStore(tmp_path / "images").put(img)
    assert store.stats["images_written"] == 1 and store.get(img.digest) == img.data
    store.path(img.digest).write_bytes(b"tampered")
    with pytest.raises(ImageStoreError, match="corrupt"):
        ImageStore(tmp_path / "images").get(img.digest)
    with pytest.raises(ImageStoreError, match="not in the store"):
        store.get("0" * 64)
    with pytest.raises(ImageStoreError, match="not an image digest"):
        store.get("../../etc/passwd")


def test_prompts_hold_screenshots_as_expanded_placeholders(engine):
    tok = engine.tokenizer
    vision = tok.vision
    _, obs = screen()
    prompt = EpisodePrompt(tok, PromptConfig(style="minimal", observation="screenshot", history_images=2),
                           obs["instruction"])
    ids = prompt.build(obs)
    shot = Image.of(obs["screenshot"])
    assert [i.digest for i in prompt.images] == [shot.digest]
    assert ids.count(vision.image_token_id) == vision.tokens_for(shot) > 0
    assert "taskbar button" not in tok.tok.decode(ids), "screenshot only: no tree text"
    for k in range(3):  # past turns keep their screenshot while within history_images
        prompt.record([*tok.encode('click("Files")'), tok.eos_id], "ok")
        ids = prompt.build(obs)
        assert len(prompt.images) == 2 and ids.count(vision.image_token_id) == 2 * vision.tokens_for(shot)
    both = EpisodePrompt(tok, PromptConfig(style="minimal", observation="both"), obs["instruction"]).build(obs)
    assert "taskbar button" in tok.tok.decode(both)
    from policy.tokenizer import ByteTokenizer
    with pytest.raises(ValueError, match="vision-language model"):
        EpisodePrompt(ByteTokenizer(), PromptConfig(observation="screenshot"), "x")
    with pytest.raises(ValueError, match="no screenshot"):
        EpisodePrompt(tok, PromptConfig(observation="screenshot"), "x").build({"text": "tree only"})


def test_the_engine_never_samples_an_image_placeholder(engine):
    tok = engine.tokenizer
    _, obs = screen()
    prompt = EpisodePrompt(tok, PromptConfig(style="minimal", observation="screenshot"), obs["instruction"])
    ids = prompt.build(obs)
    gens = engine.generate([ids] * 8, SamplingParams(max_new_tokens=24, temperature=1.5), [prompt.images] * 8)
    assert not {t for g in gens for t in g.token_ids} & set(tok.vision.banned_ids)


def _episodes(engine, store: ImageStore, n: int = 4, task: str = "sim:train:files_delete/2") -> list:
    """n sampled episodes from one screen, their images put in ``store`` as an actor does."""
    pc = PromptConfig(style="minimal", observation="both", history_images=2, max_prompt_tokens=2048)
    backends = [SimBackend(SimConfig(screenshot="png")) for _ in range(n)]
    policy = EnginePolicy(engine, SamplingParams(max_new_tokens=24))

    async def storing(ids, obs, images):
        for img in images:
            store.put(img)
        return await policy(ids, obs, images)

    async def main():
        return await asyncio.gather(*(play_episode(LocalEnv(b), storing, task, engine.tokenizer, pc, 3)
                                      for b in backends))

    return asyncio.run(main())


def _group(episodes) -> P.TrajectoryGroup:
    trajs = [ep.trajectory(uuid.uuid4().hex[:8]) for ep in episodes]
    return P.TrajectoryGroup(group_id=uuid.uuid4().hex, ticket_id="t", task_id="sim:train:files_delete/2",
                             actor_id="a", trajectories=trajs, behavior_version_min=0, behavior_version_max=0)


def test_the_learner_rebuilds_image_inputs_and_scores_tokens_as_the_engine_did(vlm_dir, engine, tmp_path):
    from learner.config import LearnerConfig
    from learner.trainer import Trainer

    store = ImageStore(tmp_path / "images")
    episodes = _episodes(engine, store)
    group = _group(episodes)
    assert all(len(t.images) == t.num_turns and t.images[0] for t in group.trajectories)
    shots = {d for t in group.trajectories for refs in t.images for d in refs}
    assert store.stats["images_written"] == len(shots), "each distinct screenshot stored once"
    assert len(shots) < sum(len(refs) for t in group.trajectories for refs in t.images), "rollouts share a screen"
    wire = P.decode(P.encode(group))
    assert wire.trajectories[0].images == group.trajectories[0].images

    cfg = LearnerConfig(lr=1e-4)
    cfg.advantage.drop_zero_variance = False
    trainer = Trainer(cfg, ModelConfig(path=str(vlm_dir)), images=ImageStore(tmp_path / "images"))
    out = trainer.train_step([wire])
    assert out.get("mismatch_tokens", 0) > 0, out
    assert out["mismatch_abs_max"] < 1e-4, out["mismatch_abs_max"]
    print(f"log-prob agreement with images: mean {out['mismatch_abs_mean']:.2e}, max {out['mismatch_abs_max']:.2e} "
          f"over {out['mismatch_tokens']} tokens")

    # a group naming an image the store does not have is dropped and counted, nothing raised
    missing = P.decode(P.encode(group))
    missing.group_id = "missing-image"
    missing.trajectories[1].images[0][0] = "f" * 64
    res = trainer.train_step([missing])
    assert res["outcomes"][missing.group_id] == "image_missing" and trainer.counters["groups_dropped_image_missing"]


def test_a_frozen_vision_tower_stays_as_loaded_while_the_language_model_learns(vlm_dir, engine, tmp_path):
    from learner.config import LearnerConfig
    from learner.trainer import Trainer

    store = ImageStore(tmp_path / "images")
    group = _group(_episodes(engine, store, n=2))
    cfg = LearnerConfig(lr=1e-3)
    cfg.advantage.drop_zero_variance = False
    trainer = Trainer(cfg, ModelConfig(path=str(vlm_dir), train_vision=False), images=store)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    group.trajectories[0].reward = 1.0  # a reward spread: the policy-gradient step moves the weights
    out = trainer.train_step([group])
    assert out.get("mismatch_tokens", 0) > 0, out
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not any(".visual." in n for n in moved), sorted(moved)[:5]
    assert any("language_model" in n for n in moved), sorted(moved)[:5]
    with pytest.raises(ValueError, match="no vision tower"):
        Trainer(LearnerConfig(), ModelConfig(train_vision=False))


def test_model_kind_is_read_from_the_checkpoint(vlm_dir, tmp_path):
    assert model_kind(ModelConfig(path=str(vlm_dir))) == "vlm"
    assert model_kind(ModelConfig()) == "causal"
    with pytest.raises(ValueError, match="needs model.path"):
        ModelConfig(kind="vlm").validate()
    bad = P.Trajectory.from_turns("x", 0.0, False, [P.TurnView(np.zeros(3, np.int32), np.zeros(1, np.int32),
                                                               np.zeros(1, np.float32), np.zeros(1, np.int32),
                                                               np.ones(1, np.uint8), 0.0, False, "", "", ("zz",))])
    with pytest.raises(P.ProtocolError, match="content hashes"):
        bad.validate()


def test_a_qwen2_5_vl_shaped_model_takes_the_same_path(tmp_path):
    """Qwen2.5-VL's vision tower (windowed attention, MLP merger) behind the same tokens and RoPE index; the
    checkpoint is made by the command a user would run."""
    from click.testing import CliRunner

    from launch.cli import main
    from learner.config import LearnerConfig
    from learner.trainer import Trainer

    made = CliRunner().invoke(main, ["tiny-checkpoint", "vlm", str(tmp_path / "vlm25"), "--arch", "qwen2_5_vl"])
    assert made.exit_code == 0, made.output
    path = tmp_path / "vlm25"
    assert made.output.strip().endswith(str(path)) and model_kind(ModelConfig(path=str(path))) == "vlm"
    engine = HFEngine(ModelConfig(path=str(path)), EngineConfig(seed=2))
    assert type(engine.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    store = ImageStore(tmp_path / "images")
    group = _group(_episodes(engine, store, n=2))
    cfg = LearnerConfig()
    cfg.advantage.drop_zero_variance = False
    out = Trainer(cfg, ModelConfig(path=str(path)), images=store).train_step([group])
    assert out.get("mismatch_tokens", 0) > 0 and out["mismatch_abs_max"] < 1e-4, out
    print(f"qwen2.5-vl log-prob agreement: mean {out['mismatch_abs_mean']:.2e}, max {out['mismatch_abs_max']:.2e} "
          f"over {out['mismatch_tokens']} tokens")


@pytest.mark.parametrize("pixels", [{}, {"max_pixels": 28 * 28 * 200},
                                    {"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 30}])
def test_image_token_counts_come_from_the_size_alone_and_match_the_processor(vlm_dir, pixels):
    """A prompt is built on the actor's event loop from the image's size only (no pixel decoding); the count is what
    the processor then produces, with model.min_pixels / max_pixels alone or together."""
    from policy.vision import VisionProcessor

    _, obs = screen()
    img = Image.of(obs["screenshot"])
    vision = VisionProcessor(vlm_dir, **pixels)
    assert vision.tokens_for(img) == int(vision.pixels(img)[1].prod()) // vision.merge ** 2


def test_the_image_processor_loads_where_transformers_top_level_name_demands_torchvision(vlm_dir, monkeypatch):
    """transformers 5.17 (the lent GPU machines' version) exports ``transformers.AutoImageProcessor`` as a placeholder
    that raises for want of torchvision, although the class itself falls back to the PIL processor. A VLM must still
    load there: the processor is taken from its own module, and gives the same pixels."""
    import transformers

    from policy.vision import VisionProcessor

    class NeedsTorchvision:
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            raise ImportError("AutoImageProcessor requires the Torchvision library but it was not found")

    monkeypatch.setattr(transformers, "AutoImageProcessor", NeedsTorchvision)
    _, obs = screen()
    img = Image.of(obs["screenshot"])
    vision = VisionProcessor(vlm_dir, max_pixels=28 * 28 * 200)
    pixels, grid = vision.pixels(img)
    monkeypatch.undo()
    expected, expected_grid = VisionProcessor(vlm_dir, max_pixels=28 * 28 * 200).pixels(img)
    assert torch.equal(grid, expected_grid) and torch.equal(pixels, expected)


def test_a_groups_first_turns_share_one_prefill_only_with_the_same_images(vlm_dir, engine):
    """The G rollouts of a group begin with one prompt and one first screenshot: one prefill (vision tower included)
    serves them all, the others take its columns, first-token logits and multimodal positions. The same prompt ids
    with another image of the same size are prefilled on their own. Greedy tokens and log-probs equal an engine's
    that prefills every request."""
    import io

    from PIL import Image as PILImage, ImageDraw

    tok = engine.tokenizer
    _, obs = screen()
    prompt = EpisodePrompt(tok, PromptConfig(style="minimal", observation="screenshot"), obs["instruction"])
    ids = prompt.build(obs)
    shot = prompt.images[0]
    with PILImage.open(io.BytesIO(shot.data)) as im:
        changed = im.convert("RGB")
    ImageDraw.Draw(changed).rectangle((0, 0, changed.width // 2, changed.height // 2), fill=(200, 30, 30))
    buf = io.BytesIO()
    changed.save(buf, format="PNG")
    other = Image.of(buf.getvalue())
    assert other.digest != shot.digest and tok.vision.tokens_for(other) == tok.vision.tokens_for(shot)
    images = [[shot]] * 4 + [[other]] * 2
    greedy = SamplingParams(max_new_tokens=12, temperature=0)

    def play(prefix_reuse: bool) -> tuple[list, HFEngine]:
        eng = HFEngine(ModelConfig(path=str(vlm_dir)), EngineConfig(seed=1, prefix_reuse=prefix_reuse))
        eng.pause()  # the group arrives in one window, as an actor submits it
        futures = [eng.submit(ids, greedy, imgs) for imgs in images]
        eng.resume()
        gens = [f.result(120) for f in futures]
        eng.close()
        return gens, eng

    shared, eng = play(True)
    assert eng.stats.prompt_tokens == 2 * len(ids) and eng.stats.prefill_batches == 1, eng.stats
    assert eng.stats.prefix_copies == 4 and eng.stats.prefix_reused_tokens == 4 * len(ids)
    alone, eng = play(False)
    assert eng.stats.prompt_tokens == 6 * len(ids) and eng.stats.prefix_copies == 0
    for a, b in zip(shared, alone):
        assert a.token_ids == b.token_ids and len(a.token_ids) > 1
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5), (a.logprobs, b.logprobs)
    assert shared[0].token_ids == shared[3].token_ids


def _recolored(shot: Image) -> Image:
    """The same screenshot with its top-left quarter painted over: another image of the same size (same tokens)."""
    import io

    from PIL import Image as PILImage, ImageDraw

    with PILImage.open(io.BytesIO(shot.data)) as im:
        changed = im.convert("RGB")
    ImageDraw.Draw(changed).rectangle((0, 0, changed.width // 2, changed.height // 2), fill=(200, 30, 30))
    buf = io.BytesIO()
    changed.save(buf, format="PNG")
    return Image.of(buf.getvalue())


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_a_later_turn_reuses_its_text_up_to_the_first_image_from_the_cache(arch, tmp_path):
    """An episode's next prompt begins with the text of the one before, up to where that one's screenshot stood. The
    cache's columns for that text serve it (their positions are the plain indices on every axis), whether from the
    slot the last turn left or copied from a request admitted beside it with the same text and another screenshot;
    the rest, images and all, is prefilled at positions moved on by the text reused. Greedy tokens and log-probs
    equal those of an engine that prefills every prompt whole. (A small rotary base: every axis's positions count.)"""
    vlm_dir = vlm_checkpoint(tmp_path / arch, corpus_episodes=20, arch=arch, rope_theta=10.0)
    backend, obs = screen()
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    reusing = HFEngine(ModelConfig(path=str(vlm_dir)), EngineConfig(seed=1))
    tok = reusing.tokenizer
    prompt = EpisodePrompt(tok, PromptConfig(style="minimal", observation="screenshot"), obs["instruction"])
    turns, first = [], []  # per turn: (ids, [its screenshot], [the other screenshot]); the two generations
    for _ in range(4):
        ids = prompt.build(obs)
        shot = prompt.images[0]
        turns.append((ids, [shot], [_recolored(shot)]))
        reusing.pause()  # both in one window: the second copies the first's text
        futures = [reusing.submit(ids, greedy, imgs) for imgs in turns[-1][1:]]
        reusing.resume()
        first.append([f.result(120) for f in futures])
        prompt.record(first[-1][0].token_ids, "no effect")
    reusing.close()
    reused, copies = reusing.stats.prefix_reused_tokens, reusing.stats.prefix_copies
    # each prompt's text before its first image (its opening marker), what the cache may hold of it
    text = [min(i for i, t in enumerate(ids) if t in tok.vision.banned_ids) for ids, _, _ in turns]
    assert all(ids[n] != tok.vision.image_token_id for (ids, _, _), n in zip(turns, text))
    assert copies >= 3 and reused > sum(text[1:]), (reused, copies, text)  # from the slots and from the copies
    assert reusing.stats.prompt_tokens + reused == 2 * sum(len(ids) for ids, _, _ in turns)
    whole = HFEngine(ModelConfig(path=str(vlm_dir)), EngineConfig(seed=1, prefix_reuse=False))
    for (ids, shot, other), gens in zip(turns, first):
        for imgs, gen in zip((shot, other), gens):
            alone = whole.generate([ids], greedy, [imgs])[0]
            assert gen.token_ids == alone.token_ids and len(gen.token_ids) > 1
            assert np.allclose(gen.logprobs, alone.logprobs, atol=1e-5), (gen.logprobs, alone.logprobs)
    whole.close()
    assert whole.stats.prefix_reused_tokens == 0


def test_a_vlm_groups_first_prompt_runs_once_with_its_images_and_the_step_is_that_of_whole_rows(vlm_dir, tmp_path):
    """The learner's side of the same sharing: a group's first turns (one prompt, one screenshot) are scored with one
    pass over the prompt, the vision tower on its image once, in the policy's pass and the reference's; the two
    steps equal those of running every row whole: loss, KL, entropy, gradient norm and every gradient."""
    import dataclasses

    from learner.config import LearnerConfig, LossConfig
    from learner.trainer import Trainer

    store = ImageStore(tmp_path / "images")
    # Episodes from an engine of its own: the module's engine samples whatever the tests run before it on this worker
    # left its generator at, and the episodes drawn decide how close the two ways' numbers come (below).
    own = HFEngine(ModelConfig(path=str(vlm_dir)), EngineConfig(seed=1))
    group = _group(_episodes(own, store))
    own.close()
    for i, t in enumerate(group.trajectories):  # rewards that differ: advantages, and so gradients, that do not vanish
        t.reward = float(i)
        t.turn_rewards[:] = float(i)
    first = group.trajectories[0].turn(0)
    assert all(np.array_equal(t.turn(0).prompt_ids, first.prompt_ids) and t.images[0] == group.trajectories[0].images[0]
               for t in group.trajectories)
    cfg = LearnerConfig(lr=1e-3, loss=LossConfig(kl_beta=0.1))
    results = {}
    for share in (False, True):
        t = Trainer(dataclasses.replace(cfg, share_prompts=share), ModelConfig(path=str(vlm_dir)), seed=0,
                    images=ImageStore(tmp_path / "images"))
        seen: list[int] = []
        for model in (t.net.module, t.ref_model):
            model.model.visual.register_forward_hook(
                lambda _m, args, kwargs, _out: seen.append(len(kwargs.get("grid_thw", args[1:2] and args[1]))),
                with_kwargs=True)
        t.train_step([P.decode(P.encode(group))], update=False)  # a probe: the first update's gradients, kept
        grads = [(n, p.grad.detach().clone()) for n, p in t.model.named_parameters() if p.grad is not None]
        t.drop_gradients()
        seen.clear()
        steps = [t.train_step([P.decode(P.encode(group))]) for _ in range(2)]
        results[share] = steps, seen, grads
    (whole, seen_whole, whole_grads), (shared, seen_shared, shared_grads) = results[False], results[True]
    # the 4 first turns' screenshot: once a pass instead of 4 times, in 2 passes a step, 2 steps
    assert sum(seen_whole) - sum(seen_shared) == 3 * 2 * 2, (seen_whole, seen_shared)
    for m_whole, m_shared in zip(whole, shared):
        assert m_whole["prompt_tokens_shared"] == 0 and m_shared["prompt_tokens_shared"] == 3 * len(first.prompt_ids)
        assert m_shared["tokens"] == m_whole["tokens"] and m_whole["grad_norm"] > 0
        for key in ("loss", "kl", "entropy", "grad_norm", "is_weight_mean"):
            assert m_shared[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-6), key
    # Gradients, not the weights after the update: Adam divides each gradient by its own scale, so summation-order
    # noise in a gradient near its epsilon moved a weight by up to 2.9e-4 at this lr, depending on the episodes drawn
    # (a rehearsal under load failed a check of the weights); a gradient is linear in what the passes computed.
    assert [n for n, _ in whole_grads] == [n for n, _ in shared_grads] and whole_grads
    scale = max(float(g.abs().max()) for _, g in whole_grads)
    for (name, a), (_, b) in zip(whole_grads, shared_grads):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5 * scale), (name, float((a - b).abs().max()), scale)


def test_images_are_processed_ahead_on_worker_threads_and_a_bad_one_fails_where_it_is_needed(vlm_dir):
    """``prefetch`` processes screenshots on the image workers (an actor's at submit, a batch's all at once); ``pixels``
    then takes them, equal to processing on the calling thread. An image that cannot be decoded raises where it is
    needed, once per use, and leaves nothing pending."""
    import threading

    from policy.vision import VisionProcessor

    shots = [Image.of(screen(f"sim:train:{task}")[1]["screenshot"])
             for task in ("screen_click_marker/1", "screen_click_marker/2", "screen_click_marker/3")]
    assert len({img.digest for img in shots}) == 3
    inline = VisionProcessor(vlm_dir, workers=0)
    ahead = VisionProcessor(vlm_dir, workers=2)
    where: list[str] = []
    process = ahead.image_processor.__class__.__call__

    def recording(self, *args, **kwargs):
        where.append(threading.current_thread().name)
        return process(self, *args, **kwargs)

    ahead.image_processor.__class__.__call__ = recording
    try:
        ahead.prefetch(shots + shots[:1])
        got = [ahead.pixels(img) for img in shots]
    finally:
        ahead.image_processor.__class__.__call__ = process
    assert len(where) == 3 and all(name.startswith("image-processor") for name in where), where
    for (pix, grid), img in zip(got, shots):
        ref_pix, ref_grid = inline.pixels(img)
        assert torch.equal(pix, ref_pix) and torch.equal(grid, ref_grid)
    from PIL import UnidentifiedImageError

    bad = Image.of(b"\x89PNG not an image at all")
    ahead.prefetch([bad])
    for _ in range(2):  # raised each time it is asked for, never cached
        with pytest.raises(UnidentifiedImageError):
            ahead.pixels(bad)
    assert not ahead._pending
    with pytest.raises(ValueError, match="image_workers"):
        ModelConfig(image_workers=-1).validate()

    # an image still queued behind others is taken back and processed where it is needed, not waited for
    one = VisionProcessor(vlm_dir, workers=1)
    release, where = threading.Event(), {}
    process = one._process

    def held(digest, load):
        where[digest] = threading.current_thread().name
        if digest == shots[0].digest:
            assert release.wait(30)
        return process(digest, load)

    one._process = held
    one.prefetch(shots)  # the one worker holds the first; the others wait in its queue
    pix, grid = one.pixels(shots[2])
    assert where[shots[2].digest] == threading.current_thread().name and shots[2].digest not in one._pending
    assert torch.equal(pix, inline.pixels(shots[2])[0])
    release.set()
    assert torch.equal(one.pixels(shots[0])[0], inline.pixels(shots[0])[0])
    assert where[shots[0].digest].startswith("image-processor")


def test_a_waiting_batchs_images_are_processed_before_its_step_and_the_step_finds_them_done(vlm_dir, engine,
                                                                                            tmp_path):
    """While a step runs, the learner's loop sets the next batch's screenshots processing on the image workers
    (``Trainer.prefetch_images``, once per batch as it arrives): its step then processes none itself. An image the
    store lacks is left to the step; at most half the processor's cache is filled ahead. By default only on a GPU
    (a CPU's cores are the step's)."""
    import collections
    import dataclasses
    import threading
    import types

    from learner.config import LearnerConfig
    from learner.process import Learner
    from learner.trainer import Trainer

    store = ImageStore(tmp_path / "images")
    batch = [_group(_episodes(engine, store, n=2, task=f"sim:train:screen_click_marker/{i}")) for i in range(3)]
    digests = {d for g in batch for t in g.trajectories for turn in t.images for d in turn}
    cfg = LearnerConfig(prefetch_images="on")
    cfg.advantage.drop_zero_variance = False
    trainer = Trainer(cfg, ModelConfig(path=str(vlm_dir)), seed=0, images=store)
    vision = trainer.vision
    processed: list[str] = []
    process = vision._process

    def counting(digest, load):
        processed.append(digest)
        assert threading.current_thread().name.startswith("image-processor"), "processed where it was needed"
        return process(digest, load)

    def settled() -> None:  # (what the workers were given, done)
        deadline = time.monotonic() + 30
        while vision._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not vision._pending

    vision._process = counting
    for mode in ("auto", "off"):  # (on this CPU)
        Trainer(dataclasses.replace(cfg, prefetch_images=mode), ModelConfig(path=str(vlm_dir)), seed=0,
                images=store).prefetch_images(batch)
    assert not processed
    trainer.prefetch_images(batch)
    trainer.prefetch_images(batch)  # (asked again: each is cached or under way, not redone)
    settled()
    assert sorted(processed) == sorted(digests) and len(digests) > 2
    out = trainer.train_step(batch)
    assert out["samples"] > 0 and sorted(processed) == sorted(digests), "the step processed an image again"

    missing = _group(_episodes(engine, ImageStore(tmp_path / "elsewhere"), n=2))  # not in the trainer's store
    lacking = [d for t in missing.trajectories for turn in t.images for d in turn][0]
    vision.cache_items = 4
    vision._cache.clear()
    processed.clear()
    trainer.prefetch_images([missing, *batch])
    settled()
    # the first two digests (half the cache): one the store lacks, left uncached, and one it has
    first_held = next(d for g in batch for t in g.trajectories for turn in t.images for d in turn)
    assert processed == [lacking, first_held] and list(vision._cache) == [first_held], processed

    # the loop's side: once per waiting batch, the one next in line, only while a step runs
    seen = []
    loop = types.SimpleNamespace(client=types.SimpleNamespace(batches=collections.deque()), _prefetched="",
                                 trainer=types.SimpleNamespace(prefetch_images=seen.append))
    prefetch_next = Learner._prefetch_next.__get__(loop)
    prefetch_next()
    batches = [P.Batch(batch_id=f"b{i}", train_version=0, groups=[g]) for i, g in enumerate(batch[:2])]
    loop.client.batches.extend(batches)
    for _ in range(3):
        prefetch_next()
    loop.client.batches.popleft()
    prefetch_next()
    prefetch_next()
    assert seen == [batches[0].groups, batches[1].groups]
