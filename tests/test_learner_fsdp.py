"""Two FSDP2 learner ranks on CPU (gloo) train exactly like one rank: same weights after RL and SFT steps
(with uneven micro-batch counts, so padding passes run; the two ranks first probe a batch, which changes nothing),
rank 1 driven only through the job channel, and a
checkpoint written by two ranks resumes on two (rank 1 reading neither the weights nor the optimizer state: rank 0
sends its shards) and on one with the identical next step. The ranks leave their groups without aborting at exit."""

from __future__ import annotations

import dataclasses
import os
import pickle

import pytest

torch = pytest.importorskip("torch")

from common import protocol as P  # noqa: E402
from common.net import free_port  # noqa: E402
from learner.checkpoint import TRAINER_FILE  # noqa: E402
from learner.config import LearnerConfig, LossConfig  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from tests.test_learner import TINY, groups_from  # noqa: E402

# 9 samples of 26 tokens, 2 rows per micro-batch; the first group's 3 share their prompt: rank 0 gets 5 samples (one
# shared micro-batch of 2 rows, then 2 whole ones), rank 1 gets 4 (a shared padding micro-batch, then 2 whole ones).
# A KL term: each rank's reference copy starts on the meta device and gets its shards from rank 0, as the policy does.
CFG = LearnerConfig(lr=1e-3, micro_batch_tokens=60, keep_checkpoints=5, loss=LossConfig(kl_beta=0.1))


def _script(jobs, groups: list, successes: P.SuccessBatch, probe: bool = False) -> list[dict]:
    """The steps every run takes, through the job channel (one rank: it just runs them). ``probe``: first a probe of
    the first batch's groups (``Trainer.probe_step``), which must change nothing the steps after it show."""
    if probe:
        jobs.run("probe", {"eta": None}, P.Batch("b0", 0, groups[:3]))
    out = [jobs.run("rl", {"eta": None}, P.Batch("b1", 0, groups[:3])),
           jobs.run("sft", {"lr": 5e-4}, successes)]
    jobs.run("advance")
    out.append(jobs.run("rl", {"eta": None}, P.Batch("b2", 0, groups[3:])))
    return out


def _rank_main(rank: int, port: int, workdir: str) -> None:
    from common import log as L
    from learner.distributed import JobChannel, from_environment

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    with open(os.path.join(workdir, "inputs.pkl"), "rb") as f:
        groups, successes = pickle.load(f)
    dist = from_environment("cpu", 60)
    trainer = Trainer(CFG, TINY, dist=dist)
    jobs = JobChannel(dist, trainer)
    if rank == 1:
        import safetensors.torch

        # what this rank reads of the checkpoint it resumes from: its shards come from rank 0
        reads = {"weights": 0, "mapped": []}
        load_file, load = safetensors.torch.load_file, torch.load

        def counting_load_file(*a, **kw):
            reads["weights"] += 1
            return load_file(*a, **kw)

        def recording_load(f, *a, **kw):
            if str(f).endswith(TRAINER_FILE):  # (torch.distributed's object collectives unpickle with it too)
                reads["mapped"].append(bool(kw.get("mmap")))
            return load(f, *a, **kw)

        safetensors.torch.load_file, torch.load = counting_load_file, recording_load
        jobs.follow(L.get())  # everything below happens here too, announced by rank 0
        jobs.follow(L.get())  # second phase: load and one more step
        with open(os.path.join(workdir, "rank1.pkl"), "wb") as f:
            pickle.dump(reads, f)
        dist.close()
        return
    metrics = _script(jobs, groups, successes, probe=True)  # the one-rank reference probes nothing
    jobs.run("gather")
    broadcast = {n: t.clone() for n, t in trainer.weights_for_broadcast()}
    path = jobs.run("save", {"root": os.path.join(workdir, "ck")})
    jobs.stop()
    # Resume from that checkpoint on both ranks and take one more step.
    jobs.run("load", {"path": str(path)})
    nxt = groups_from(Trainer(CFG, TINY), n_groups=2, g=3, seed=9, version=trainer.version)
    after = jobs.run("rl", {"eta": None}, P.Batch("b3", trainer.version, nxt))
    jobs.stop()
    with open(os.path.join(workdir, "rank0.pkl"), "wb") as f:
        pickle.dump({"metrics": metrics, "broadcast": broadcast, "path": str(path), "next": after, "nxt": nxt,
                     "version": trainer.version}, f)
    dist.close()


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * max(1.0, abs(a))


@pytest.mark.slow
def test_two_fsdp_ranks_train_like_one(tmp_path):
    import torch.multiprocessing as mp

    ref = Trainer(CFG, TINY)
    # groups whose rollouts begin with one prompt, run once (share_prompts): in the first batch one rank has a shared
    # micro-batch and the other none; in the second each rank has shared ones
    groups = (groups_from(ref, n_groups=1, g=3, seed=3, same_prompt=True) + groups_from(ref, n_groups=2, g=3, seed=1) +
              groups_from(ref, n_groups=2, g=4, seed=2, same_prompt=True))
    successes = P.SuccessBatch([P.SuccessSample(g.task_id, t) for g in groups[:2] for t in g.trajectories
                                if t.success])
    with open(tmp_path / "inputs.pkl", "wb") as f:
        pickle.dump((groups, successes), f)
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    with open(tmp_path / "rank0.pkl", "rb") as f:
        got = pickle.load(f)
    with open(tmp_path / "rank1.pkl", "rb") as f:
        rank1 = pickle.load(f)
    # rank 1 resumed (the continuation below equals one rank's) without reading the weights or the optimizer state
    assert rank1["weights"] == 0 and rank1["mapped"] == [True], rank1

    from learner.distributed import DistContext, JobChannel

    want = _script(JobChannel(DistContext(), ref), groups, successes)
    for m_ref, m_two in zip(want, got["metrics"]):
        assert m_two["tokens"] == m_ref["tokens"]
        assert _close(m_two["loss"], m_ref["loss"]) and _close(m_two["entropy"], m_ref["entropy"])
        assert _close(m_two["grad_norm"], m_ref["grad_norm"])
        assert ("kl" in m_ref) == ("kl" in m_two) and _close(m_two.get("kl", 0.0), m_ref.get("kl", 0.0))
    assert want[2]["kl"] > 0, "after two updates the policy has moved from its reference"
    for k in (0, 2):
        assert want[k]["prompt_tokens_shared"] > 0 and got["metrics"][k]["prompt_tokens_shared"] > 0
    assert ref.version == 4
    names = [n for n, _ in ref.model.named_parameters()]
    assert list(got["broadcast"]) == names, "the actors get every parameter, full size, in parameter order"
    for n, p in ref.model.named_parameters():
        assert torch.allclose(got["broadcast"][n], p.detach(), atol=1e-5), n

    # The two-rank checkpoint resumes on one rank, identically to the two-rank continuation.
    one = Trainer(CFG, dataclasses.replace(TINY, init_seed=77))
    state = one.load(got["path"])
    assert state["version"] == 4 and one.version == 4
    m = one.train_step(got["nxt"])
    assert _close(m["loss"], got["next"]["loss"]) and m["tokens"] == got["next"]["tokens"]
    assert one.version == got["version"] == 5


def test_closing_waits_until_gloo_lets_go_of_the_last_collectives_tensor(monkeypatch):
    """gloo's worker thread drops its reference to a collective's tensor after the caller's wait returns;
    freeing a Python tensor there takes the GIL, which a thread cannot take while the interpreter exits
    (the process aborts). ``close`` must not go on to tear down while that reference is held."""
    import threading
    import time

    from learner.distributed import DistContext

    seen: dict = {}

    class Work:
        def wait(self, timeout=None):
            return True

    def all_reduce(tensor, group=None, async_op=False):
        seen["tensor"] = tensor
        worker_holds = [tensor.view(-1)]  # the worker thread's reference, let go of a little later
        threading.Thread(target=lambda: (time.sleep(0.2), worker_holds.clear())).start()
        return Work() if async_op else None

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "destroy_process_group",
                        lambda: seen.setdefault("use_count_at_teardown", seen["tensor"]._use_count()))
    DistContext(rank=1, world_size=2).close()
    assert seen["use_count_at_teardown"] == 1


def test_a_job_channel_collective_waits_the_training_timeout_at_most_and_says_which():
    """The job channel's group waits a week (a follower waits there for rank 0's next job); its collectives that every
    rank makes together wait ``learner.dist_timeout_s`` at most, and the error names the setting and the job."""
    import datetime

    from learner.distributed import DistContext

    asked = []

    class Hung:  # gloo's answer when a connected rank never joins
        def wait(self, timeout=None):
            asked.append(timeout)
            raise RuntimeError("Operation timed out!")

    with pytest.raises(RuntimeError, match=r"learner rank 0: the job channel's rl waited 7 s \(learner.dist_timeout_s\)"):
        DistContext(rank=0, world_size=2, timeout_s=7).job_wait(Hung(), "rl")
    assert asked == [datetime.timedelta(seconds=7)]


def test_a_model_built_on_the_meta_device_has_the_real_ones_parameters_and_buffers(tmp_path):
    """What a learner rank other than 0 builds (``build_model(meta=True)``) before rank 0 sends it its shards: every
    parameter and buffer the real model has, with its shape and dtype, and no memory. From the architecture fields,
    from a checkpoint whose embedding has fewer rows than the tokenizer (resized with no values to average), and a
    VLM."""
    from launch.tiny_checkpoints import vlm_checkpoint
    from policy.model import ModelConfig, build_model

    small = tmp_path / "small"
    build_model(dataclasses.replace(TINY, vocab_size=0), 200).save_pretrained(small)
    vlm = vlm_checkpoint(tmp_path / "vlm", corpus_episodes=5)
    for cfg, vocab in ((TINY, 263), (ModelConfig(path=str(small)), 263), (ModelConfig(path=str(vlm)), 0)):
        if not vocab:  # the VLM's own tokenizer
            from policy.model import build_tokenizer
            vocab = build_tokenizer(cfg).vocab_size
        real = build_model(cfg, vocab, dtype=torch.float32, keep_on_cpu=True)
        meta = build_model(cfg, vocab, dtype=torch.float32, keep_on_cpu=True, meta=True)
        for named in ("named_parameters", "named_buffers"):
            got = {n: (tuple(t.shape), t.dtype) for n, t in getattr(meta, named)()}
            assert got == {n: (tuple(t.shape), t.dtype) for n, t in getattr(real, named)()}, (cfg, named)
            assert all(t.is_meta for _, t in getattr(meta, named)())
        assert type(meta) is type(real)
