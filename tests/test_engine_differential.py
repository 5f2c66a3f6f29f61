"""The HF engine under random load against a reference computed one request at a time.

Each seed draws an engine configuration (slots, window length, prefill chunking, prefix reuse, overlapped windows,
interrupting swaps) and a workload of GRPO groups playing multi-turn episodes: the rollouts of a group share a first
prompt, every prompt begins with the same rules, a later turn's prompt is the turn before's prompt, its output and
an observation (sometimes with the history cut short). Turns arrive at random windows, as an actor's episodes send
them; some are cancelled by their caller while they run; new weights arrive at random windows, and so do relabels
(a newer version of the same weights); in some seeds passes fail now and then, failing the requests in flight.

Every token of every request must then be what one teacher-forced pass of the weights of its version gives for it
alone: its log-prob (under its temperature, stop ids banned before ``min_new_tokens``), the argmax for a greedy row,
a token inside the nucleus for a top-p row. Each generation must end as it says (``length``, ``eos`` at its first
stop id, ``stop`` at the token that completed its stop string), and the engine must end with every slot free and
nothing in flight. A token sampled after a swap that landed mid-request is checked for its label only: it attends
over columns the older weights wrote, by design.

A VLM's seeds put screenshots in the prompts (a group's rollouts share their first prompt's, a later turn may add
one), so the twins, the text reused up to a first image and the multimodal positions moved on by it are drawn too.

``COMPUTERRL_ENGINE_SEEDS=N`` runs N text seeds and N // 4 VLM seeds instead of the quick tier's (a soak)."""

from __future__ import annotations

import copy
import io
import os
import random
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from actor.engine import EngineConfig, Generation, SamplingParams  # noqa: E402
from actor.hf_engine import HFEngine  # noqa: E402
from common.images import Image  # noqa: E402
from policy.model import BANNED_LOGIT, ModelConfig, ban, cache_keyword  # noqa: E402

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
SOAK = int(os.environ.get("COMPUTERRL_ENGINE_SEEDS", "0"))
TEXT_SEEDS, VLM_SEEDS = (SOAK, max(1, SOAK // 4)) if SOAK else (24, 6)
COVERAGE_TEXT_SEEDS = 6
"""text seeds that the coverage test runs (and checks as any seed); the per-seed test runs the others"""
ALPHABET = "abcdefgh ()=,.xyz"  # short prompts over few symbols share prefixes; ")" is a stop string


@dataclass
class Turn:
    prompt: list[int]
    params: SamplingParams
    images: list = field(default_factory=list)
    future: object = None
    gen: Generation | None = None
    cancelled: bool = False
    failed: BaseException | None = None


@dataclass
class Rollout:
    """One episode of a group: its turns so far and how many it will play."""

    turns_left: int
    turns: list[Turn] = field(default_factory=list)
    done: bool = False


def screenshots(rng: random.Random, n: int) -> list[Image]:
    """``n`` small PNGs of random colours and two sizes (4 or 6 image tokens in the tiny VLM)."""
    from PIL import Image as PILImage

    out = []
    for i in range(n):
        buf = io.BytesIO()
        PILImage.new("RGB", (56, 56) if i % 2 else (84, 56), tuple(rng.randrange(256) for _ in range(3))).save(
            buf, format="PNG")
        out.append(Image.of(buf.getvalue()))
    return out


class Workload:
    """GRPO groups of multi-turn episodes, driven from the engine's own thread (its ``step_hook``, before each
    window) and from the test's thread while the engine is paused, so one seed mostly replays one interleaving."""

    def __init__(self, rng: random.Random, eng: HFEngine, versions: dict):
        self.rng, self.eng, self.versions = rng, eng, versions
        self.tok = eng.tokenizer
        self.vision = eng.vision
        self.shots = screenshots(rng, 4) if self.vision else []
        self.rules = self.text(24, 40)
        self.groups_left = rng.randint(3, 10)
        self.rollouts: list[Rollout] = []
        self.ready: list[Rollout] = []  # whose last turn finished: the next one is due
        self.lock = threading.Lock()
        self.swaps_left = rng.choice([0, 1, 2, 2])
        self.relabels = 0

    def text(self, lo: int, hi: int) -> list[int]:
        return self.tok.encode("".join(self.rng.choice(ALPHABET) for _ in range(self.rng.randint(lo, hi))))

    def screen(self) -> tuple[list[int], list[Image]]:
        """A screenshot as the prompt holds it (its opening marker, its placeholders, its closing one), or nothing
        for a text model."""
        if not self.vision:
            return [], []
        shot = self.rng.choice(self.shots)
        config = self.eng.model.config
        return ([config.vision_start_token_id] + [self.vision.image_token_id] * self.vision.tokens_for(shot)
                + [config.vision_end_token_id]), [shot]

    def params(self) -> SamplingParams:
        rng = self.rng
        temperature = rng.choice([0.0, 0.7, 1.0, 1.0])
        new = rng.choice([1, 2, 3, 5, 8, 13, 21])
        return SamplingParams(temperature=temperature, top_p=rng.choice([1.0, 1.0, 0.8]), max_new_tokens=new,
                              stop=[")"] if rng.random() < 0.4 else [],
                              min_new_tokens=rng.randint(1, new) if rng.random() < 0.25 else 0)

    def start_group(self) -> None:
        self.groups_left -= 1
        shown, images = self.screen()
        first = self.rules + shown + self.text(1, 30)
        params = self.params()  # a group's first turns are sampled alike
        for _ in range(self.rng.choice([1, 2, 4])):
            ro = Rollout(self.rng.randint(1, 3))
            self.rollouts.append(ro)
            self.submit(ro, list(first), params, images)

    def submit(self, ro: Rollout, prompt: list[int], params: SamplingParams, images: list[Image]) -> None:
        turn = Turn(prompt, params, list(images))
        ro.turns.append(turn)
        ro.turns_left -= 1
        turn.future = self.eng.submit(prompt, params, images)
        turn.future.add_done_callback(lambda f, ro=ro, turn=turn: self.finished(ro, turn, f))

    def finished(self, ro: Rollout, turn: Turn, f) -> None:
        if f.cancelled():
            turn.cancelled, ro.done = True, True
            return
        if f.exception() is not None:  # (a failed window: the test fails with it, once the workload has ended)
            turn.failed, ro.done = f.exception(), True
            return
        turn.gen = f.result()
        with self.lock:
            if ro.turns_left > 0:
                self.ready.append(ro)
            else:
                ro.done = True

    def next_turn(self, ro: Rollout) -> None:
        last = ro.turns[-1]
        history, images = last.prompt + last.gen.token_ids, last.images
        if not self.vision and self.rng.random() < 0.15:  # the history cut short: only the rules are shared
            history = self.rules + history[len(self.rules) + self.rng.randint(1, 20):]
        shown, shot = self.screen() if self.rng.random() < 0.5 else ([], [])
        prompt, params = history + self.text(1, 20) + shown, self.params()
        if len(prompt) + params.max_new_tokens > self.eng.max_seq_len:  # (as an actor's episode ends at its limit)
            with self.lock:
                ro.done = True
            return
        self.submit(ro, prompt, params, images + shot)

    def act(self, everything: bool) -> None:
        """Submit due turns (each with some chance, or all), maybe start a group, cancel a turn or swap weights."""
        rng = self.rng
        with self.lock:
            due = [ro for ro in self.ready if everything or rng.random() < 0.6]
            self.ready = [ro for ro in self.ready if ro not in due]
        for ro in due:
            self.next_turn(ro)
        if self.groups_left and (everything or rng.random() < 0.2):
            self.start_group()
        running = [t for ro in self.rollouts if not ro.done for t in ro.turns[-1:] if t.gen is None]
        if running and rng.random() < 0.04:
            rng.choice(running).future.cancel()
        if rng.random() < 0.05:  # the learner moved on without changing its latest weights (staged or swapped in)
            version = max(self.versions) + 1
            self.versions[version] = self.versions[version - 1]
            self.eng.relabel(version)
            self.relabels += 1
        if self.swaps_left and rng.random() < 0.12:
            self.swaps_left -= 1
            version = max(self.versions) + 1
            model = self.versions[version] = copy.deepcopy(self.versions[0])
            noise = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=noise) * 0.05)
            self.eng.load_weights(dict(model.named_parameters()), version)

    def finished_all(self) -> bool:
        with self.lock:
            return not self.groups_left and not self.ready and all(ro.done for ro in self.rollouts)


def teacher_forced_logits(eng: HFEngine, model, turn: Turn) -> "torch.Tensor":
    """The logits one pass of ``model`` gives at each of ``turn``'s sampled positions, over the columns the engine
    samples from."""
    ids = torch.tensor([turn.prompt + turn.gen.token_ids])
    extra = (eng.vision.model_inputs(model, ids, torch.ones_like(ids), [turn.images]) if eng.vision else {})
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0, len(turn.prompt) - 1:-1, :eng.vocab].float()
    return ban(logits, eng.banned)


def stepwise_logits(eng: HFEngine, versions: dict, turn: Turn) -> "torch.Tensor":
    """The logits at each of ``turn``'s sampled positions as the engine computed them across swaps: token ``i`` by
    the weights of its version, attending over the columns the weights of their time wrote (the prompt's by token
    0's weights, which prefilled it; each output token's by the weights that fed it back, those of the token after
    it). A text model's: one token at a time on a cache that carries over between weights."""
    from transformers import DynamicCache

    g = turn.gen
    cache, rows = DynamicCache(), []
    with torch.no_grad():
        for i, version in enumerate(g.versions):
            fed = turn.prompt if i == 0 else [g.token_ids[i - 1]]
            start = 0 if i == 0 else len(turn.prompt) + i - 1
            model = versions[version]
            out = model(input_ids=torch.tensor([fed]), position_ids=torch.arange(start, start + len(fed))[None],
                        use_cache=True, **{cache_keyword(model.forward): cache})
            rows.append(out.logits[0, -1, :eng.vocab].float())
    return torch.stack(rows)


def check_turn(eng: HFEngine, turn: Turn, versions: dict, where: str) -> int:
    """The checks of the module's docstring for one finished turn; how many tokens were compared with a pass."""
    g, p, tok = turn.gen, turn.params, eng.tokenizer
    n = len(g.token_ids)
    assert 1 <= n <= p.max_new_tokens and len(g.logprobs) == len(g.versions) == n, where
    stops = tok.stop_ids
    at_stop = [i for i, t in enumerate(g.token_ids) if t in stops]
    assert all(i >= p.min_new_tokens for i in at_stop), f"{where}: a stop id before min_new_tokens"
    if g.finish == "eos":
        assert at_stop == [n - 1], f"{where}: eos ends at the first stop id"
    else:
        assert not at_stop, f"{where}: {g.finish} with a stop id inside"
    if g.finish == "length":
        assert n == p.max_new_tokens, where
    texts = [tok.decode([t for t in g.token_ids[:k] if t not in stops]) for k in range(1, n + 1)]
    hits = [k for k, text in enumerate(texts) if any(s in text for s in p.stop)]
    if g.finish == "stop":
        assert hits and hits[0] == n - 1, f"{where}: cut at the token that completed the stop string"
    else:
        assert not hits, f"{where}: {g.finish} past a stop string"
    assert g.versions == sorted(g.versions), f"{where}: versions go back"
    # One pass of one version's weights where they sampled every token (a relabel changes the version, not the
    # weights); for a text model that a swap reached mid-request, the same weights in turn as the engine had them.
    # (A VLM's tokens past such a swap are left unchecked: its multimodal positions make a stepwise pass a model of
    # its own.)
    model = versions[g.versions[0]]
    same = next((i for i, v in enumerate(g.versions) if versions[v] is not model), n)
    if same == n or eng.vision is not None:
        logits = teacher_forced_logits(eng, model, turn)[:same]
    else:
        logits, same = stepwise_logits(eng, versions, turn), n
    early = torch.arange(same) < p.min_new_tokens
    stop_cols = torch.tensor(sorted(stops))
    logits[:, stop_cols] = torch.where(early[:, None], torch.full_like(logits[:, stop_cols], BANNED_LOGIT),
                                       logits[:, stop_cols])
    logp = torch.log_softmax(logits / (p.temperature or 1.0), dim=-1)
    tokens = torch.tensor(g.token_ids[:same])
    ours = logp.gather(-1, tokens[:, None]).squeeze(-1)
    np.testing.assert_allclose(np.array(g.logprobs[:same]), ours.numpy(), atol=3e-5,
                               err_msg=f"{where}: log-probs against a teacher-forced pass of versions "
                                       f"{g.versions[:same]}")
    top2 = logp.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # (a near tie may go either way between batch shapes)
    if p.temperature == 0:
        assert bool(((logp.argmax(-1) == tokens) | ~clear).all()), f"{where}: greedy tokens are the argmax"
    elif p.top_p < 1:
        probs = logp.exp()
        above = (probs > probs.gather(-1, tokens[:, None])).float()
        mass_before = (probs * above).sum(-1)  # of the tokens more likely than the one drawn
        assert bool((mass_before < p.top_p + 1e-4).all()), f"{where}: a token outside the nucleus"
    return same


class InjectedFault(RuntimeError):
    pass


def inject_faults(eng: HFEngine, seed: int) -> dict:
    """Make the engine's admissions and windows fail now and then, before or after they did their work (a device
    error mid-pass): the requests in flight fail with it, and every later one must be served as if none had."""
    draw = random.Random(seed ^ 0x5EED)  # (the engine's thread alone draws from it)
    counts = {"raised": 0}

    def failing(real):
        def call(*args, **kwargs):
            if draw.random() < 0.02:
                counts["raised"] += 1
                raise InjectedFault(f"before {real.__name__}")
            out = real(*args, **kwargs)
            if draw.random() < 0.02:
                counts["raised"] += 1
                raise InjectedFault(f"after {real.__name__}")
            return out
        return call

    for name in ("_prefill", "_copy_prefixes", "_decode_window"):
        setattr(eng, name, failing(getattr(eng, name)))
    return counts


def run_seed(seed: int, model: ModelConfig = TINY) -> dict:
    rng = random.Random(seed)
    cfg = EngineConfig(seed=seed, max_batch=rng.choice([2, 3, 4, 6]), sync_every=rng.choice([1, 2, 3, 5, 8, 16]),
                       prefill_tokens=rng.choice([16, 40, 512]), prefix_reuse=rng.random() < 0.8,
                       overlap=rng.choice(["never", "always"]), interrupt=rng.random() < 0.7,
                       max_seq_len=rng.choice([400, 127, 95]))  # (short ones: rows end at their slot's last column)
    eng = HFEngine(model, cfg)
    versions = {0: copy.deepcopy(eng.model)}
    work = Workload(rng, eng, versions)
    faults = inject_faults(eng, seed) if rng.random() < 0.25 else None
    where = f"seed {seed}, {cfg}" + (", faults injected" if faults else "")
    eng.step_hook = lambda: work.act(everything=False)
    try:
        for _ in range(400):
            if work.finished_all():
                break
            eng.pause()  # between bursts the test's thread submits while the engine waits: one order of events
            work.act(everything=True)
            eng.resume()
            eng.wait_idle(120)
        else:
            pytest.fail(f"{where}: the workload did not finish")
        eng.wait_idle(120)
        assert (sorted(eng.free_slots) == list(range(cfg.max_batch)) and not eng._by_slot and not eng._spent
                and not eng._waiting and eng._pending is None), f"{where}: a slot or a request left in flight"
        checked = turns = 0
        for i, ro in enumerate(work.rollouts):
            for k, turn in enumerate(ro.turns):
                assert turn.failed is None or (faults and isinstance(turn.failed, InjectedFault)), \
                    f"{where}, rollout {i} turn {k}: {turn.failed!r}"
                if turn.failed is not None:
                    continue
                if turn.cancelled:
                    continue
                turns += 1
                checked += check_turn(eng, turn, versions, f"{where}, rollout {i} turn {k}")
        return {"turns": turns, "checked_tokens": checked, "swaps": eng.stats.weight_swaps, "relabels": work.relabels,
                "reused": eng.stats.prefix_reused_tokens, "copies": eng.stats.prefix_copies,
                "faults": faults["raised"] if faults else 0}
    finally:
        eng.close()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> ModelConfig:
    from launch.tiny_checkpoints import vlm_checkpoint

    # a small rotary base: every multimodal axis's positions count, so positions moved on wrongly show
    return ModelConfig(path=str(vlm_checkpoint(tmp_path_factory.mktemp("vlm"), corpus_episodes=20, rope_theta=10.0)))


@pytest.mark.parametrize("seed", range(COVERAGE_TEXT_SEEDS, TEXT_SEEDS))
def test_every_token_under_random_load_is_what_its_version_gives_the_request_alone(seed):
    run_seed(seed)


@pytest.mark.parametrize("kind", ["text", "vlm"])
def test_the_random_workloads_pass_and_reach_what_they_are_meant_to_test(kind, request):
    """The first seeds of each kind (every VLM seed), checked as every seed is, and over them the cases the workloads
    are for: they reuse prefixes, copy them between slots, swap and relabel weights mid-run, meet failing passes and
    compare most tokens with a pass. A generator that stopped producing those cases would pass every seed's check."""
    model, seeds = (TINY, range(COVERAGE_TEXT_SEEDS)) if kind == "text" else \
        (request.getfixturevalue("vlm"), range(1000, 1000 + VLM_SEEDS))
    totals = [run_seed(seed, model) for seed in seeds]
    assert sum(t["reused"] for t in totals) > 0 and sum(t["copies"] for t in totals) > 0
    assert sum(t["swaps"] for t in totals) > 0 and sum(t["relabels"] for t in totals) > 0
    assert sum(t["faults"] for t in totals) > 0
    assert sum(t["checked_tokens"] for t in totals) > 100
