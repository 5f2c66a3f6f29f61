"""The actor: prompts as token ids, engine log-probs vs a teacher-forced pass, weight swaps mid-generation,
and a whole actor against a real broker and env_server on loopback."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from actor.agent import Actor  # noqa: E402
from actor.config import ActorConfig  # noqa: E402
from actor.engine import EngineConfig, SamplingParams  # noqa: E402
from actor.hf_engine import HFEngine  # noqa: E402
from actor.prompt import EpisodePrompt, PromptConfig  # noqa: E402
from broker.client import LearnerBrokerClient  # noqa: E402
from broker.config import BrokerConfig  # noqa: E402
from policy.model import ModelConfig, build_model, sequence_logprobs  # noqa: E402
from common import protocol as P  # noqa: E402
from common.net import free_port  # noqa: E402
from common.rundir import RunDir  # noqa: E402
from policy.tokenizer import ByteTokenizer  # noqa: E402
from policy.weightsync import WeightSender, WeightSyncConfig  # noqa: E402
from env_server.sim.backend import SimBackend  # noqa: E402
from env_server.config import EnvServerConfig  # noqa: E402
from env_server.server import EnvServer  # noqa: E402
from tests.conftest import make_net, stage_weights_before_window  # noqa: E402

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def test_prompt_keeps_sampled_ids_verbatim_and_cuts_oldest_history_first():
    tok = ByteTokenizer()
    b = SimBackend()
    obs = b.reset("sim:train:files_rename/0")
    p = EpisodePrompt(tok, PromptConfig(history_turns=2, max_prompt_tokens=4096), obs["instruction"])
    first = p.build(obs)
    text = tok.decode(first)
    assert obs["instruction"] in text and "taskbar button" in text and "click(" in text  # rules + screen
    assert first[-1] == tok.special("<|assistant|>")
    sampled = tok.encode('open_app("Files")') + [tok.eos_id]
    res = b.step('open_app("Files")')
    p.record(sampled, res.obs["last_result"])
    second = p.build(res.obs)
    n = len(sampled)
    assert any(second[i:i + n] == sampled for i in range(len(second) - n)), "sampled ids appear as sampled"
    head = len(p.renderer.render(p.head)) - 1  # the rules and the task, without the generation prompt
    assert head > 100 and second[:head] == first[:head], "the fixed head is shared, not re-tokenized differently"
    for k in range(3):
        p.record(tok.encode(f"wait() #{k}"), "waited")
    third = tok.decode(p.build(res.obs))
    assert "#2" in third and "#1" in third and "#0" not in third and 'open_app("Files")' not in third
    small = EpisodePrompt(tok, PromptConfig(max_prompt_tokens=900), obs["instruction"])
    for k in range(4):
        small.record(tok.encode(f"wait() #{k}"), "waited")
    cut = small.build(res.obs)
    assert len(cut) <= 900 and cut[-1] == tok.special("<|assistant|>")


def test_the_role_token_layout_is_the_one_the_base_policy_learned():
    """The byte layout the shipped base policy was cloned on, id for id: a change here would silently cost it."""
    tok = ByteTokenizer()
    sys_, user, asst, end = (tok.special(t) for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"))
    enc = tok.encode
    p = EpisodePrompt(tok, PromptConfig(style="minimal", history_turns=1), "do x")
    obs = {"text": "screen", "apis": ["Files.open"]}
    assert p.build(obs) == [user, *enc("Task: do x"), end, user, *enc("Step 0.\nscreen"), end, asst]
    p.record([*enc("act()"), end], "ok")
    p.record(enc("cut"), "r2")  # cut at max_new_tokens: the end marker is added after it
    assert p.build(obs) == [user, *enc("Task: do x"), end, user, *enc("Step 1."), end, asst, *enc("cut"), end,
                            user, *enc("Result: r2"), end, user, *enc("Step 2.\nscreen"), end, asst]
    full = EpisodePrompt(tok, PromptConfig(style="full"), "do x").build(obs)
    assert full[0] == sys_ and full[full.index(end) + 1] == user
    assert tok.decode(full).endswith("Step 0.\nscreen\nAPI of the focused app: Files.open")


def test_recorded_logprobs_equal_a_teacher_forced_pass():
    eng = HFEngine(TINY, EngineConfig(seed=3, max_batch=3))
    tok = eng.tokenizer
    prompts = [tok.encode("short"), tok.encode("a much longer prompt that pads the others " * 3), tok.encode("mid x")]
    for params in (SamplingParams(temperature=1.0, max_new_tokens=24),
                   SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=24, stop=[")"])):
        gens = eng.generate(prompts * 2, params)  # 6 prompts: two batches of max_batch=3
        assert len(gens) == 6
        for prompt, g in zip(prompts * 2, gens):
            assert len(g.token_ids) == len(g.logprobs) == len(g.versions) > 0
            if g.finish == "stop":
                assert ")" in g.text
            seq = torch.tensor([prompt + g.token_ids])
            with torch.no_grad():
                ref = sequence_logprobs(eng.model, seq, temperature=params.temperature)[0, len(prompt) - 1:]
            np.testing.assert_allclose(np.array(g.logprobs), ref.numpy(), atol=2e-5)


def test_weights_swap_at_a_token_boundary_and_match_the_learner(quiet_log):
    eng = HFEngine(TINY, EngineConfig(seed=0, interrupt=True))
    tok = eng.tokenizer
    learner = build_model(ModelConfig(**{**TINY.__dict__, "init_seed": 99}), tok.vocab_size).eval()
    cfg = WeightSyncConfig(port=free_port(), join_window_s=5.0, timeout_s=10.0)
    sender = WeightSender(cfg, quiet_log)
    r, e = sender.open_round()
    from policy.weightsync import WeightReceiver

    received = {}

    def receive():
        received["v"], received["t"] = WeightReceiver(cfg, quiet_log).receive(r, e, eng.named_parameters())

    t = threading.Thread(target=receive)
    t.start()
    sender.broadcast(list(learner.named_parameters()), version=5, expected=1)
    t.join(10)
    assert received["v"] == 5
    prompt = tok.encode("click(")
    params = SamplingParams(temperature=1.0, max_new_tokens=20)
    before = eng.generate([prompt], params)[0]
    stage_weights_before_window(eng, 6, received["t"], received["v"])
    mid = eng.generate([prompt], params)[0]
    eng.step_hook = None
    # the prefill samples token 1, each window one more (sync_every 1 on CPU), window 6 still on the old weights:
    # 7 tokens before the swap
    assert mid.versions[:7] == [0] * 7 and set(mid.versions[7:]) == {5}, mid.versions
    after = eng.generate([prompt] * 2, params)
    for g in after:
        assert set(g.versions) == {5}
        seq = torch.tensor([prompt + g.token_ids])
        with torch.no_grad():
            ref = sequence_logprobs(learner, seq)[0, len(prompt) - 1:]
        np.testing.assert_allclose(np.array(g.logprobs), ref.numpy(), atol=2e-5)
    with torch.no_grad():
        lp_old = sequence_logprobs(build_model(TINY, tok.vocab_size).eval(), torch.tensor([prompt + before.token_ids]))
        lp_new = sequence_logprobs(eng.model, torch.tensor([prompt + before.token_ids]))
    assert not torch.allclose(lp_old, lp_new), "the update changed the policy"


def _start_env_server(tb, tmp_path, log, **kw) -> tuple[EnvServer, threading.Thread, str]:
    """An env_server on sim desktops in a thread, for an actor under test to play on: it, its thread, its address."""
    env_cfg = EnvServerConfig(port=free_port(), **kw)
    server = EnvServer(env_cfg, tb.net, RunDir.create(tmp_path / "env"), log)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    return server, thread, f"127.0.0.1:{env_cfg.port}"


@pytest.mark.parametrize("pool_size,cross", [(8, True), (1, False)])
def test_actor_publishes_well_formed_groups(start_broker, quiet_log, tmp_path, pool_size, cross):
    """With a pool smaller than the episodes in flight, episodes wait for a desktop instead of failing. The broker
    gives one rollout of each group to a cross policy: an actor with one (other weights, saved at version 7) plays
    the group's last rollout with it and names the slot; an actor without one plays it with its own, and counts it."""
    # Liveness of seconds, not the fixtures' 0.6 s: the checks below hold the actor's loop for a while, and on a
    # loaded machine the env_server must not take that silence for a death (it would reclaim the sessions).
    tb = start_broker(BrokerConfig(groups_per_batch=2, group_size=2, eta=4, persist=True, cross_policy_share=0.5),
                      net=make_net(liveness=25))
    server, st, address = _start_env_server(tb, tmp_path, quiet_log, pool_size=pool_size)
    cfg = ActorConfig(env_servers=[address], max_groups=2, max_steps=3,
                      sampling=SamplingParams(max_new_tokens=24), prompt=PromptConfig(max_prompt_tokens=2048))
    engine = HFEngine(TINY, EngineConfig(seed=1))
    other = None
    if cross:
        other = HFEngine(TINY, EngineConfig(seed=2))
        other.load_weights({k: v + 0.05 for k, v in other.model.state_dict().items()}, 7)
    actor = Actor(cfg, engine, tb.net, None, tb.run_dir, quiet_log, max_groups_total=2, cross_engine=other)
    learner = LearnerBrokerClient(tb.net, None, quiet_log)
    learner.connect(10)
    try:
        actor.connect(10)
        actor.run()
        assert actor.stats["groups_submitted"] == 2 and actor.broker.unacked == 0, dict(actor.stats)
        assert actor.stats["cross_policy_episodes"] == (2 if cross else 0)
        assert actor.stats["cross_policy_slots_played_on_policy"] == (0 if cross else 2)
        assert actor.stats["env_failures"] == 0 and (actor.env.pool_waits > 0) == (pool_size == 1)
        # Closed at once, before the checks below hold this thread: an actor whose loop has ended no longer
        # heartbeats, and on a loaded machine those checks outlasted the env_server's liveness (it then reclaimed
        # the sessions of an actor it took for dead, which is not what this test is about).
        opened = server.counters["sessions_opened"]
        actor.close()
        # Leaving gives every session back at once; none waits to be reclaimed as a dead actor's.
        assert server.pool_stats()["sessions"] == 0 and server.counters["sessions_closed"] == opened
        assert server.counters["sessions_reclaimed"] == 0
        learner.grant(1)
        batch = learner.next_batch(10)
        assert batch is not None and len(batch.groups) == 2
        for g in batch.groups:
            assert g.complete and g.actor_id == actor.broker.actor_id and len(g.trajectories) == 2
            assert g.task_id.startswith("sim:train/")
            assert g.cross_policy_slots == ([1] if cross else [])
            assert (g.behavior_version_min, g.behavior_version_max) == (0, 0), "the current policy's span"
            for k, tr in enumerate(g.trajectories):
                played_by = other if k in g.cross_policy_slots else engine
                assert 1 <= tr.num_turns <= 3 and set(tr.versions.tolist()) == {played_by.version}
                assert tr.loss_mask.sum() == len(tr.output_ids) and len(tr.actions) == tr.num_turns
                turn = tr.turn(0)
                seq = torch.tensor([np.concatenate([turn.prompt_ids, turn.output_ids]).tolist()])
                with torch.no_grad():
                    ref = sequence_logprobs(played_by.model, seq)[0, len(turn.prompt_ids) - 1:]
                np.testing.assert_allclose(turn.logprobs, ref.numpy(), atol=2e-5)
                assert engine.tokenizer.decode(turn.output_ids.tolist()).startswith(tr.actions[0][:5])
        metrics = (tb.run_dir.metrics / "actor-0.jsonl").read_text()
        assert '"gen_tokens_per_s"' in metrics and '"engine_idle_ratio"' in metrics
        last = json.loads(metrics.splitlines()[-1])  # the engine's busy time by phase
        assert 0 < last["engine_prefill_share"] < 1 and last["engine_decode_ms_per_step"] > 0, last
    finally:
        actor.close()
        learner.close()
        server.request_stop()
        st.join(10)
        if other is not None:
            other.close()


def test_an_actor_whose_every_episode_raises_exits_for_a_fresh_start(start_broker, quiet_log, tmp_path):
    """An engine that fails every call (after a CUDA error, every later call fails too) left the actor taking
    tickets and failing their episodes for ever, the run standing still. Past actor.max_episode_errors in a row it
    exits with the last error, so its supervisor restarts it, and gives the run up with that error if it persists;
    the groups it failed were never acked, and their tasks go out again."""
    from actor.agent import ActorCannotPlay

    tb = start_broker(BrokerConfig(groups_per_batch=2, group_size=2, eta=4), net=make_net(liveness=25))
    server, st, address = _start_env_server(tb, tmp_path, quiet_log, pool_size=4)
    cfg = ActorConfig(env_servers=[address], max_groups=2, max_steps=3, max_episode_errors=5,
                      sampling=SamplingParams(max_new_tokens=8), prompt=PromptConfig(max_prompt_tokens=2048))
    engine = HFEngine(TINY, EngineConfig(seed=1))
    actor = Actor(cfg, engine, tb.net, None, tb.run_dir, quiet_log)

    async def broken(*args, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    actor.engine_policy = broken
    try:
        actor.connect(10)
        with pytest.raises(ActorCannotPlay, match=r"episodes in a row raised \(actor.max_episode_errors 5\); the "
                                                  r"last: RuntimeError\('CUDA error: an illegal memory access"):
            actor.run()
        assert actor.stats["episode_errors"] >= 5 and actor.stats["groups_submitted"] == 0, dict(actor.stats)
        assert actor.stats["groups_lost"] >= 2 and actor.broker.unacked == 0
    finally:
        actor.close()
        server.request_stop()
        st.join(10)
        engine.close()


def test_the_workflow_explorer_plays_a_slot_of_each_group_and_marks_it_unsampled(start_broker, quiet_log, tmp_path):
    """actor.workflows: the explorer plays the last rollout of every group of a family it has demonstrations of;
    the trajectory says no model sampled it and carries the version it served; the policy's rollouts are as ever."""
    from actor.config import WorkflowsConfig
    from actor.demos import record_demos
    from actor.workflow_explorer import WorkflowExplorer, workflows_of
    from env_server.backend_registry import task_registry

    cfg_b = BrokerConfig(groups_per_batch=2, group_size=3, eta=4)
    cfg_b.tasks.suite = "sim:train:infeasible"
    tb = start_broker(cfg_b, net=make_net(liveness=25))
    server, st, address = _start_env_server(tb, tmp_path, quiet_log, pool_size=6)
    prompt = PromptConfig(max_prompt_tokens=2048)
    registry = task_registry("sim", "")
    demos = record_demos("sim:train:infeasible", 2, prompt, ByteTokenizer(), route="gui")
    explorer = WorkflowExplorer(workflows_of(demos, registry), registry=registry)
    cfg = ActorConfig(env_servers=[address], max_groups=2, max_steps=3,
                      sampling=SamplingParams(max_new_tokens=24), prompt=prompt,
                      workflows=WorkflowsConfig(suite="sim:train:infeasible", demos=2, slots=1))
    engine = HFEngine(TINY, EngineConfig(seed=1))
    actor = Actor(cfg, engine, tb.net, None, tb.run_dir, quiet_log, max_groups_total=2, explorer=explorer)
    learner = LearnerBrokerClient(tb.net, None, quiet_log)
    learner.connect(10)
    try:
        actor.connect(10)
        actor.run()
        assert actor.stats["groups_submitted"] == 2 and actor.broker.unacked == 0, dict(actor.stats)
        assert actor.stats["explored_episodes"] == 2 and actor.stats["episodes"] == 4
        assert explorer.episodes("infeasible") == 2
        assert actor.stats["explored_successes"] == explorer.successes("infeasible")
        actor.close()
        learner.grant(1)
        batch = learner.next_batch(10)
        assert batch is not None and len(batch.groups) == 2
        for g in batch.groups:
            assert [t.sampled for t in g.trajectories] == [True, True, False]
            explored = g.trajectories[2]
            assert set(explored.versions.tolist()) == {engine.version}
            assert explored.num_turns >= 1 and not explored.logprobs.any(), "actions written, not sampled"
            assert explored.actions[0].startswith("open_app("), "the demos' first step: a literal app start"
            assert g.played() == g.trajectories[:2]
    finally:
        actor.close()
        learner.close()
        server.request_stop()
        st.join(10)


def test_a_stopped_actor_leaves_once_the_broker_has_left_and_counts_what_it_abandoned(start_broker, quiet_log,
                                                                                         tmp_path):
    """A learner that finished says stop; the broker leaves broker.stop_grace_s later. An actor with rollouts still
    running waited out its whole stop_grace_s for acks nobody could send (30 s at the end of every run); it now leaves
    once the broker's link has gone silent, and counts and logs what it left."""
    from env_server.sim.backend import SimConfig

    tb = start_broker(BrokerConfig(groups_per_batch=2, group_size=2, eta=4, stop_grace_s=0.2))
    slow = SimConfig(latency="fixed", latency_mean_s=1.0)  # every step a second: rollouts are in flight at the stop
    server, st, address = _start_env_server(tb, tmp_path, quiet_log, pool_size=4, sim=slow)
    cfg = ActorConfig(env_servers=[address], max_groups=2, max_steps=8, stop_grace_s=120.0,
                      sampling=SamplingParams(max_new_tokens=8), prompt=PromptConfig(max_prompt_tokens=2048))
    actor = Actor(cfg, HFEngine(TINY, EngineConfig(seed=1)), tb.net, None, tb.run_dir, quiet_log)
    learner = LearnerBrokerClient(tb.net, None, quiet_log)
    learner.connect(10)
    actor.connect(10)
    runner = threading.Thread(target=actor.run, daemon=True)
    try:
        runner.start()
        deadline = time.monotonic() + 30
        while actor.groups_started < 1:
            assert time.monotonic() < deadline, "no rollout started"
            learner.poll(0.05)
        learner.set_control(0, stop=True)
        stopped_at = time.monotonic()
        while runner.is_alive() and time.monotonic() - stopped_at < 60:
            learner.poll(0.05)
        assert not runner.is_alive(), "the actor still waits for acks from a broker that has left"
        assert time.monotonic() - stopped_at < 30  # dead_after_s is 2 s here; stop_grace_s 120 s
        tb.thread.join(10)
        assert not tb.thread.is_alive(), "the broker left after its own stop grace"
        left = actor.stats["rollouts_abandoned_at_stop"] + actor.stats["groups_unacked_at_stop"]
        assert left >= 1, actor.stats
    finally:
        actor.close()
        learner.close()
        server.request_stop()
        st.join(10)


def test_engine_loads_a_local_hf_checkpoint_and_tokenizer(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["click the Save button", 'open_app("Files")', "type hello world"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "[PAD]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(tmp_path)
    model = build_model(TINY, len(fast))
    model.save_pretrained(tmp_path)
    cfg = ModelConfig(path=str(tmp_path), tokenizer="hf")
    eng = HFEngine(cfg, EngineConfig(seed=0))
    tok = eng.tokenizer
    assert tok.special("<|end|>") >= len(fast), "role tokens were added to the vocabulary"
    assert eng.model.get_input_embeddings().num_embeddings >= tok.vocab_size
    prompt = [tok.special("<|user|>"), *tok.encode("click the Save button"), tok.special("<|assistant|>")]
    g = eng.generate([prompt], SamplingParams(max_new_tokens=8))[0]
    with torch.no_grad():
        ref = sequence_logprobs(eng.model, torch.tensor([prompt + g.token_ids]))[0, len(prompt) - 1:]
    np.testing.assert_allclose(np.array(g.logprobs), ref.numpy(), atol=2e-5)
    with torch.no_grad():  # the weights are the saved ones, not a fresh init
        name, saved = next(iter(model.named_parameters()))
        assert torch.equal(dict(eng.model.named_parameters())[name][:saved.shape[0]], saved)


def test_vllm_engine_parts_that_run_without_vllm(tmp_path):
    import importlib.util

    from actor.engine import VLLMConfig
    from actor.engine_factory import make_engine
    from actor.vllm_engine import Partial, engine_args, visible_device
    from policy.model import parameter_layout
    from policy.weightsync import layout_hash

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(RuntimeError, match="pip install 'computerrl\\[gpu\\]'"):
            make_engine(ModelConfig(path="/nonexistent"), EngineConfig(kind="vllm"))
    part = Partial([1, 2, 3])
    part.add([7, 8], [-0.1, -0.2], version=4)
    part.add([9], [-0.3], version=5)  # resumed with new weights after an interruption
    assert part.continuation(SamplingParams(max_new_tokens=10)) == ([1, 2, 3, 7, 8, 9], 7)
    assert part.versions == [4, 4, 5]
    # The layout of a model.path checkpoint, from its config on the meta device (from_pretrained cannot run
    # there), with the embeddings grown to the tokenizer as build_model grows them.
    tok = ByteTokenizer()
    small = dataclasses.replace(TINY, vocab_size=200)
    build_model(small, 200).save_pretrained(tmp_path / "ckpt")
    ckpt = ModelConfig(path=str(tmp_path / "ckpt"), tokenizer="byte")
    layout = parameter_layout(ckpt, tok.vocab_size)
    real = list(build_model(ckpt, tok.vocab_size).named_parameters())
    assert [(n, tuple(t.shape)) for n, t in real] == layout and real[0][1].shape[0] == tok.vocab_size > 200
    meta = [(n, torch.empty(shape, device="meta")) for n, shape in layout]
    learner_side = [(n, t.to(torch.bfloat16)) for n, t in real]  # a GPU learner sends bf16
    assert layout_hash(meta) == layout_hash(learner_side), "a round from the learner fits the vLLM workers' layout"
    # Engine arguments: a byte-tokenizer checkpoint has nothing for vLLM to load; the memory knobs pass through.
    cfg = EngineConfig(kind="vllm", seed=3, vllm=VLLMConfig(gpu_memory_utilization=0.7, max_model_len=4096,
                                                            enforce_eager=True, tensor_parallel_size=2))
    args = engine_args(ckpt, cfg)
    assert args["skip_tokenizer_init"] and args["gpu_memory_utilization"] == 0.7 and args["max_model_len"] == 4096
    assert args["enforce_eager"] and args["tensor_parallel_size"] == 2 and args["dtype"] == "bfloat16"
    assert cfg.weight_receivers == 2 and EngineConfig().weight_receivers == 1
    assert "max_model_len" not in engine_args(ckpt, EngineConfig(kind="vllm"))
    # engine.device picks the GPU through CUDA_VISIBLE_DEVICES (vLLM has no device argument)
    assert visible_device("cuda", None) is None and visible_device("cuda:1", None) == "1,0"
    assert visible_device("cuda:1", "4,5,6") == "5,6,4"
    with pytest.raises(ValueError, match="runs on GPUs"):
        visible_device("cpu", None)
    with pytest.raises(ValueError, match="only 2 GPUs"):
        visible_device("cuda:2", "0,1")


class _Out:
    def __init__(self, ids, finished=False, reason=None):
        from types import SimpleNamespace

        lps = [{t: SimpleNamespace(logprob=-0.01 * (k + 1))} for k, t in enumerate(ids)]
        self.outputs = [SimpleNamespace(token_ids=list(ids), logprobs=lps, finish_reason=reason)]
        self.finished = finished


class _FakeAsyncLLM:
    """Stands in for vLLM's AsyncLLM where the engine's own logic is under test (vLLM is not installed here)."""

    def __init__(self, streams, rpc_error=None):
        self.streams, self.rpc_error, self.calls = list(streams), rpc_error, []

    async def generate(self, inputs, sampling, rid):
        self.calls.append(("generate", list(inputs), sampling))
        for out in self.streams.pop(0):
            yield out

    async def abort(self, rid):
        self.calls.append(("abort",))

    async def pause_generation(self, mode, clear_cache):
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self):
        self.calls.append(("resume",))

    async def reset_prefix_cache(self):
        self.calls.append(("reset",))

    def shutdown(self):
        self.calls.append(("shutdown",))

    async def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method))
        if self.rpc_error is not None:
            raise self.rpc_error
        return [9, 9]


def _vllm_engine_with(llm):
    import asyncio
    import threading
    from types import SimpleNamespace

    from actor.engine import EngineStats
    from actor.vllm_engine import VLLMEngine

    eng = object.__new__(VLLMEngine)  # everything __init__ sets but vLLM itself
    eng.cfg, eng.tokenizer, eng.own_tokenizer = EngineConfig(kind="vllm"), ByteTokenizer(), False
    eng.version = eng.content_version = 0
    eng.stats, eng._layout, eng.llm = EngineStats(), [("w", (2,))], llm
    eng._busy_lock, eng._in_flight, eng._busy_since = threading.Lock(), 0, 0.0
    eng.vllm = SimpleNamespace(SamplingParams=lambda **kw: kw)
    eng._inputs = lambda ids, images: ids
    eng._loop = asyncio.new_event_loop()
    eng._thread = threading.Thread(target=eng._loop.run_forever, daemon=True)
    eng._thread.start()
    eng._gate = asyncio.Event()
    eng._loop.call_soon_threadsafe(eng._gate.set)
    return eng


def test_vllm_engine_stops_on_its_own_stop_strings_and_continues_after_a_pause():
    tok = ByteTokenizer()
    said = tok.encode("click(3)</act> and more")
    cut = len(tok.encode("click(3)</act>"))
    llm = _FakeAsyncLLM([[_Out(said[:4]), _Out(said[:4], finished=True, reason="abort")],  # paused for a swap
                         [_Out(said[4:9]), _Out(said[4:], finished=False)]])
    eng = _vllm_engine_with(llm)
    params = SamplingParams(max_new_tokens=40, stop=["</act>"])
    eng.version = 2
    gen = eng.generate([[1, 2]], params)[0]
    assert gen.token_ids == said[:cut] and gen.finish == "stop", "kept up to the stop string, the rest dropped"
    assert llm.calls[-1] == ("abort",), "vLLM is told to stop drawing tokens nobody will use"
    sampling = llm.calls[0][2]
    assert sampling["detokenize"] is False and "stop" not in sampling, "vLLM has no tokenizer to check them with"
    assert llm.calls[1][1] == [1, 2] + said[:4] and llm.calls[1][2]["max_tokens"] == 36, "a continuation"
    with pytest.raises(ValueError, match="top_p=1"):
        eng.generate([[1]], SamplingParams(top_p=0.9))
    eng.close()  # (a loop left running would close the aborted stream whenever it is collected, logging there)


def test_a_failed_vllm_swap_is_a_round_failed_and_generation_resumes():
    from policy.weightsync import RoundFailed, WeightSyncConfig

    llm = _FakeAsyncLLM([], rpc_error=RuntimeError("worker 1: RoundFailed: peer died"))
    eng = _vllm_engine_with(llm)
    receiver = type("R", (), {"cfg": WeightSyncConfig()})()
    with pytest.raises(RoundFailed, match="peer died"):
        eng.receive_round(3, 1, receiver)
    assert [c[0] for c in llm.calls] == ["pause", "rpc", "resume"] and llm.calls[0][1:] == ("abort", True)
    assert eng.version == 0, "old weights, old label"
    llm.streams.append([_Out([65], finished=True, reason="length")])
    assert eng.generate([[1]], SamplingParams(max_new_tokens=1))[0].token_ids == [65], "the gate is open again"
    llm.rpc_error = None
    assert eng.receive_round(4, 1, receiver) == 9 and eng.version == 9
    eng.close()
    assert llm.calls[-1] == ("shutdown",) and not eng._thread.is_alive(), "vLLM shut down, then the loop stopped"

def test_actor_joins_weight_rounds_announced_on_control(start_broker, quiet_log, tmp_path):
    tb = start_broker(BrokerConfig(groups_per_batch=1, group_size=2, eta=8, persist=False))
    server, _, address = _start_env_server(tb, tmp_path, quiet_log, pool_size=4)
    wcfg = WeightSyncConfig(port=free_port(), join_window_s=10.0, timeout_s=10.0)
    sender = WeightSender(wcfg, quiet_log)
    cfg = ActorConfig(env_servers=[address], max_groups=1, max_steps=2,
                      sampling=SamplingParams(max_new_tokens=8), prompt=PromptConfig(max_prompt_tokens=1024))
    engine = HFEngine(TINY, EngineConfig(seed=2))
    actor = Actor(cfg, engine, tb.net, wcfg, tb.run_dir, quiet_log, max_groups_total=4)
    learner = LearnerBrokerClient(tb.net, None, quiet_log)
    learner.connect(10)
    learner.set_control(0)
    actor.connect(10)
    runner = threading.Thread(target=actor.run, daemon=True)
    runner.start()
    try:
        learner.grant(1)
        first = learner.next_batch(30)
        assert first is not None and first.groups[0].behavior_version_max == 0
        new_weights = build_model(ModelConfig(**{**TINY.__dict__, "init_seed": 7}), engine.tokenizer.vocab_size)
        r, e = sender.open_round()
        learner.set_control(1, weights=P.WeightRound(round=r, epoch=e, sender=sender.incarnation))
        assert sender.broadcast(list(new_weights.named_parameters()), version=1, expected=1) == 1
        later = []
        for _ in range(3):
            learner.grant(1)
            b = learner.next_batch(30)
            assert b is not None
            later += b.groups
        assert later[-1].behavior_version_max == 1, "groups started after the round carry the new version"
        assert actor.stats["weight_updates"] == 1
        for name, p in new_weights.named_parameters():
            assert torch.equal(dict(engine.model.named_parameters())[name], p)
        runner.join(30)
        assert not runner.is_alive()
    finally:
        actor.close()
        learner.close()
        server.request_stop()


def test_engine_relabels_unchanged_weights_and_never_over_staged_ones():
    eng = HFEngine(TINY, EngineConfig(seed=0))
    eng.relabel(3)
    assert eng.version == 3 and eng.content_version == 0
    g = eng.generate([eng.tokenizer.encode("x")], SamplingParams(max_new_tokens=3))[0]
    assert set(g.versions) == {3}
    eng.load_weights(dict(eng.named_parameters()), 5)  # staged, not yet swapped
    eng.relabel(4)
    assert eng.version == 3, "staged weights pending: no relabel"
    eng.generate([eng.tokenizer.encode("x")], SamplingParams(max_new_tokens=1))
    assert eng.version == eng.content_version == 5


@pytest.mark.parametrize("body, expected", [
    ("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')", "sdpa"),
    ("", "flash_attention_2"),
])
def test_flash_attn_is_used_only_when_it_loads(tmp_path, monkeypatch, body, expected):
    # A wheel built for another torch ABI is found by find_spec and fails only when its extension loads.
    import sys
    import warnings

    from policy.model import attention_implementation

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert attention_implementation("cuda", torch.bfloat16) == expected
    assert any("undefined symbol" in str(w.message) for w in caught) == (expected == "sdpa")
    assert attention_implementation("cpu", torch.float32) == "sdpa"
    assert attention_implementation("cuda", torch.float32) == "sdpa", "flash-attn needs half precision"
