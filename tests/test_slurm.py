"""Slurm: the sbatch script a run renders and the placement it shows, bad submissions refused before anything is
written, preemption handling (a signal checkpoints and requeues, a cap on requeues, a cancel that does not requeue),
and — on a real three-node Slurm cluster of our own — runs spread over the nodes that are preempted, resumed,
watched and cancelled with every acked group trained once or dropped with a reason."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from common.exitcodes import EXIT_RESUMABLE
from common.net import free_port
from launch.cli import main
from launch.config import load_run_config
from launch.placement import Node, allocation_roles
from launch.slurm import SrunConfig, attempts_ended, check_cpus, job_files, render_script
from learner.distributed import ranks_from_slurm
from tests.conftest import REPO, whole_checkpoint

def _run_cfg(*overrides: str):
    return load_run_config(str(REPO / "configs" / "local.yaml"), overrides)


def test_the_script_carries_the_slurm_section_and_slurms_preemption_conventions(tmp_path):
    cfg = _run_cfg("slurm.partition=gpu", "slurm.account=proj7", "slurm.qos=high", "slurm.time=02:00:00",
                   "slurm.gres=gpu:1", "slurm.mem=64G", "slurm.cpus_per_task=16", "slurm.signal_grace_s=240",
                   "slurm.sbatch_lines=['--constraint=a100']", "slurm.modules=['cuda/12.4']",
                   "slurm.setup=['source /opt/venv/bin/activate']", "slurm.python=/opt/venv/bin/python",
                   "slurm.max_requeues=3")
    cfg.slurm.env = {"NCCL_DEBUG": "WARN"}
    script = render_script(cfg, tmp_path / "run", tmp_path / "run" / "config.yaml")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=proj7", "#SBATCH --qos=high", "#SBATCH --time=02:00:00",
                 "#SBATCH --gres=gpu:1", "#SBATCH --mem=64G", "#SBATCH --cpus-per-task=16", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR2@240", "#SBATCH --open-mode=append", "#SBATCH --constraint=a100",
                 "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1",
                 "module load cuda/12.4", "source /opt/venv/bin/activate", "export NCCL_DEBUG=WARN",
                 '  if [ "$n" -ge 3 ]; then'):
        assert line in script.splitlines(), line
    assert "/opt/venv/bin/python -m launch.cli run" in script and "--srun" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    cfg.slurm.requeue = False
    assert "--no-requeue" in render_script(cfg, tmp_path, tmp_path / "c.yaml")
    for bad, match in [({"learner_nodes": 2}, "learner_nodes 2 > slurm.nodes 1"),
                       ({"sbatch_lines": ["rm -rf /"]}, "sbatch/srun option"),
                       ({"signal_grace_s": 70000}, "0..65535"),
                       ({"actor": SrunConfig(args=["; reboot"])}, "sbatch/srun option")]:
        c = _run_cfg().slurm
        for k, v in bad.items():
            setattr(c, k, v)
        with pytest.raises(ValueError, match=re.escape(match)):
            c.validate()


def test_a_dry_run_renders_the_multi_node_placement(tmp_path):
    """1 GPU node (broker + learner) and 3 CPU nodes (an env_server each, 6 actors dealt round-robin)."""
    r = CliRunner().invoke(main, ["slurm", "submit", "configs/local.yaml", "slurm.nodes=4", "local.actors=6",
                                  "slurm.gres=gpu:1", "slurm.learner.gpus=1", "slurm.learner.cpus=8",
                                  "slurm.learner.mem=64G", "slurm.env_server.cpus=4", "--dry-run",
                                  "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    placed = {m.group(1): m.group(2) for m in re.finditer(r"^#   (\S+)\s+(srun .*)$", r.output, re.M)}
    assert list(placed) == ["broker-0", "env_server-0", "env_server-1", "env_server-2", "learner-0",
                            *(f"actor-{i}" for i in range(6))]
    node = {k: re.search(r"--nodelist=<node (\d)>", v).group(1) for k, v in placed.items()}
    assert node == {"broker-0": "0", "learner-0": "0", "env_server-0": "1", "env_server-1": "2", "env_server-2": "3",
                    "actor-0": "1", "actor-1": "2", "actor-2": "3", "actor-3": "1", "actor-4": "2", "actor-5": "3"}
    assert placed["learner-0"].endswith("--exact --cpus-per-task=8 --gpus-per-task=1 --mem=64G")
    assert placed["env_server-1"].endswith("--exact --cpus-per-task=4")
    assert placed["actor-4"].endswith("--overlap") and placed["broker-0"].endswith("--overlap")
    assert all("--nodes=1 --ntasks=1 " in v and "--kill-on-bad-exit=1" in v for v in placed.values())
    assert "#SBATCH --nodes=4" in r.output and "#SBATCH --gres=gpu:1" in r.output
    assert not (tmp_path / "run").exists(), "a dry run writes nothing"


def test_rollout_nodes_as_their_own_heterogeneous_component(tmp_path):
    """A GPU node for the learner, CPU-only nodes from another partition for the desktops and actors."""
    r = CliRunner().invoke(main, ["slurm", "submit", "configs/local.yaml", "slurm.nodes=3", "local.actors=4",
                                  "slurm.partition=gpu", "slurm.gres=gpu:1", "slurm.learner.gpus=1",
                                  "slurm.rollout.separate=true", "slurm.rollout.partition=cpu",
                                  "slurm.rollout.exclusive=true", "--dry-run", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    sbatch = [line for line in r.output.splitlines() if line.startswith("#SBATCH")]
    split = sbatch.index("#SBATCH hetjob")
    assert {"#SBATCH --nodes=1", "#SBATCH --partition=gpu", "#SBATCH --gres=gpu:1"} <= set(sbatch[:split])
    assert sbatch[split + 1:] == ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=cpu",
                                  "#SBATCH --exclusive"]
    placed = dict(re.findall(r"^#   (\S+)\s+srun .*--nodelist=<node \d> .*?(--het-group=\d)", r.output, re.M))
    assert placed == {"broker-0": "--het-group=0", "learner-0": "--het-group=0", "env_server-0": "--het-group=1",
                      "env_server-1": "--het-group=1", **{f"actor-{i}": "--het-group=1" for i in range(4)}}


def test_the_allocation_is_read_from_slurms_variables(tmp_path, monkeypatch):
    """Node names from `scontrol show hostnames`, addresses from `scontrol show node` (stand-in scontrol here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("""#!/bin/bash
case "$1 $2" in
  "show hostnames") case "$3" in gpu1) echo gpu1;; "cpu[1-2]") printf 'cpu1\\ncpu2\\n';; esac;;
  "show node") for n in ${4//,/ }; do echo "NodeName=$n Arch=x86_64 NodeAddr=10.1.0.${n: -1} NodeHostName=$n"; done;;
esac
""")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    from launch.slurm import allocation_nodes
    het = {"SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu1",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "cpu[1-2]"}
    assert allocation_nodes(het) == [Node("gpu1", "10.1.0.1", 0), Node("cpu1", "10.1.0.1", 1),
                                     Node("cpu2", "10.1.0.2", 1)]
    assert allocation_nodes({"SLURM_JOB_NODELIST": "cpu[1-2]"}) == [Node("cpu1", "10.1.0.1"), Node("cpu2", "10.1.0.2")]
    with pytest.raises(RuntimeError, match="needs a Slurm allocation"):
        allocation_nodes({})
    cfg = _run_cfg("local.actors=2", "slurm.nodes=3", "slurm.rollout.separate=true", "slurm.env_server.cpus=3")
    nodes = allocation_nodes(het)
    roles = allocation_roles(cfg, nodes, [], False)
    with pytest.raises(RuntimeError, match="reserve 3 CPUs .* holds 2 there"):
        check_cpus(roles, cfg.slurm, nodes, {"SLURM_JOB_CPUS_PER_NODE_HET_GROUP_0": "8",
                                             "SLURM_JOB_CPUS_PER_NODE_HET_GROUP_1": "2(x2)"})


STEPS_TOOLS = """#!/bin/bash
# squeue --steps: the job's steps, learner-0's until scancel killed it; scancel: recorded, then learner-0's step gone
if [ "$(basename "$0")" = scancel ]; then echo "$@" >> "$LOG"; [ -n "$SCANCEL_FAILS" ] && { echo refused >&2; exit 1; }
  touch "$LOG.killed"; exit 0; fi
echo "$@" >> "$LOG"
[ -e "$LOG.killed" ] || echo "4242.3 learner-0"
echo "4242.4 actor-0"
echo "4242.batch batch"
"""


def test_a_role_killed_under_slurm_has_its_step_killed_where_it_runs(tmp_path, monkeypatch):
    """Killing a hung role's ``srun`` left its task to Slurm's cancellation of the step: TERM, then KILL after the
    cluster's KillWait, so a hung learner went on holding its ports while its successor failed to bind them (on the
    test cluster). The supervisor now has the step itself killed (``scancel --signal=KILL``), found by its name, and
    waits until Slurm no longer lists it."""
    from launch.placement import Role
    from launch.slurm import kill_step

    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for tool in ("squeue", "scancel"):
        (bin_dir / tool).write_text(STEPS_TOOLS)
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("LOG", str(log))
    learner = Role("learner", 0, [], True, nodes=(Node("cn1", "10.0.0.1"),))
    job = {"SLURM_JOB_ID": "4242"}
    assert kill_step(learner, job) == "step 4242.3 killed (scancel --signal=KILL)"
    calls = log.read_text().splitlines()
    assert calls[0] == "--steps --noheader --format=%i %j --jobs=4242" and "--signal=KILL 4242.3" in calls
    assert calls.index("--signal=KILL 4242.3") < len(calls) - 1, "squeue asked again after the kill"
    assert kill_step(Role("env_server", 1, [], True), job) == "no step named env_server-1 in job 4242 to kill"
    # A heterogeneous job: each component's steps are listed under the component's own job id.
    het = {**job, "SLURM_HET_SIZE": "2", "SLURM_JOB_ID_HET_GROUP_0": "4242", "SLURM_JOB_ID_HET_GROUP_1": "4243"}
    assert kill_step(Role("actor", 1, [], True), het) == "no step named actor-1 in job 4242,4243 to kill"
    assert log.read_text().splitlines()[-1] == "--steps --noheader --format=%i %j --jobs=4242,4243"
    assert "only its srun is killed" in kill_step(learner, {})
    (tmp_path / "calls.killed").unlink()
    monkeypatch.setenv("SCANCEL_FAILS", "1")
    assert kill_step(learner, job) == "scancel --signal=KILL 4242.3 failed: refused"
    monkeypatch.delenv("SCANCEL_FAILS")
    assert kill_step(learner, job, timeout_s=0.0).startswith("step 4242.3 killed")
    # Slurm still lists it past the wait (a node that does not answer): said, and the supervisor goes on.
    (bin_dir / "scancel").write_text("#!/bin/bash\nexit 0\n")
    (tmp_path / "calls.killed").unlink()
    assert kill_step(learner, job, timeout_s=0.6) == "step 4242.3 sent SIGKILL, still listed after 1 s"


def test_jobs_on_the_default_ports_get_ports_apart_and_a_config_that_chose_its_own_keeps_them(monkeypatch):
    """Two jobs on one node (`slurm.exclusive` is off by default), both on the default ports: the job whose broker
    started second failed at once (its broker could not bind). Under `slurm.ports: auto` a config on the defaults binds
    its job's range; a requeued job gets its range again; ports a config chose are kept."""
    from launch.local import PORT_KEYS, fit_to_local_run, port_of
    from launch.slurm import JOB_PORTS, job_port_base, job_ports

    monkeypatch.delenv("COMPUTERRL_PORT_RANGE", raising=False)
    ranges = [set(range(job_port_base(j), job_port_base(j) + len(PORT_KEYS))) for j in (4242, 4243, 4244)]
    assert not (ranges[0] & ranges[1] or ranges[1] & ranges[2])
    assert job_port_base(4242 + 2128) == job_port_base(4242), "2,128 ranges before one repeats (docs/slurm.md)"
    assert all(JOB_PORTS[0] <= p <= JOB_PORTS[1] for r in ranges for p in r), "below the ephemeral range"
    cfg = _run_cfg("slurm.nodes=2")
    assert job_ports(cfg, {"SLURM_JOB_ID": "4242"}) == f"ports from {job_port_base(4242)} (slurm.ports: auto, job 4242)"
    fit_to_local_run(cfg)
    assert [port_of(cfg, k) for k in PORT_KEYS] == sorted(ranges[0])
    nodes = [Node("n0", "10.0.0.0"), Node("n1", "10.0.0.1")]
    actor = next(r for r in allocation_roles(cfg, nodes, [], resume=False) if r.name == "actor")
    assert f"actor.env_servers=['10.0.0.1:{cfg.env_server.port}']" in actor.args, "the actors find the moved env_server"
    for kept in (_run_cfg("net.broker_front_port=30001"), _run_cfg("slurm.ports=config"),
                 _run_cfg("local.port_base=31000")):
        before = [port_of(kept, k) for k in PORT_KEYS] + [kept.local.port_base]
        assert job_ports(kept, {"SLURM_JOB_ID": "4242"}) == ""
        assert [port_of(kept, k) for k in PORT_KEYS] + [kept.local.port_base] == before
    assert job_ports(_run_cfg(), {}) == "", "outside a job"
    monkeypatch.setenv("COMPUTERRL_PORT_RANGE", "21000-21999")  # the test suite's workers: within a worker's range
    assert 21000 <= job_port_base(4242) and job_port_base(4242) + len(PORT_KEYS) - 1 <= 21999
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="slurm.ports must be auto or config"):
        _run_cfg("slurm.ports=node")


def test_a_resume_under_a_new_job_id_takes_that_jobs_port_range(tmp_path, monkeypatch):
    """The range `slurm.ports: auto` picked used to be saved in what the run was asked for, so a `slurm resume` days
    later, under a new job id, bound the first job's range: one picked to stay apart from the jobs running then, not
    from those running beside the resume. Now each attempt fits its own job's range after the request is saved."""
    from launch.cli.base import prepare_run
    from launch.config import resumed_config
    from launch.slurm import job_port_base

    monkeypatch.delenv("COMPUTERRL_PORT_RANGE", raising=False)
    run = tmp_path / "run"
    rd = prepare_run(_run_cfg("slurm.nodes=2"), str(run), job_env={"SLURM_JOB_ID": "4242"})
    assert load_run_config(str(rd.requested_config)).local.port_base == 0, "the request keeps the default ports"
    assert load_run_config(str(rd.config)).local.port_base == job_port_base(4242)
    cfg, _ = resumed_config(str(rd.config), [], run)  # the Slurm script's resume
    rd = prepare_run(cfg, str(run), job_env={"SLURM_JOB_ID": "4242"})
    assert load_run_config(str(rd.config)).local.port_base == job_port_base(4242), "a requeue keeps its range"
    cfg, _ = resumed_config(str(rd.config), [], run)
    rd = prepare_run(cfg, str(run), job_env={"SLURM_JOB_ID": "9001"})
    assert job_port_base(9001) != job_port_base(4242)
    assert load_run_config(str(rd.config)).local.port_base == job_port_base(9001), "a new job id: its own range"
    cfg, _ = resumed_config(str(rd.config), ["local.port_base=31000"], run)
    rd = prepare_run(cfg, str(run), job_env={"SLURM_JOB_ID": "9002"})
    assert load_run_config(str(rd.config)).local.port_base == 31000, "ports a resume chose are kept"


def test_allocation_roles_wire_addresses_and_learner_ranks():
    cfg = _run_cfg("local.actors=3", "local.learner_ranks=4", "slurm.nodes=4", "slurm.learner_nodes=2")
    nodes = [Node(f"n{i}", f"10.0.0.{i}") for i in range(4)]
    roles = {r.label: r for r in allocation_roles(cfg, nodes, ["--config", "c.yaml"], resume=True)}
    assert list(roles) == ["broker-0", "env_server-0", "env_server-1", "learner-0", "actor-0", "actor-1", "actor-2"]
    learner = roles["learner-0"]
    assert [n.name for n in learner.nodes] == ["n0", "n1"] and learner.tasks == 4
    assert learner.env == {"MASTER_ADDR": "10.0.0.0", "MASTER_PORT": str(cfg.local.learner_dist_port)}
    assert "--ranks-from-slurm" in learner.args and "--resume" in learner.args
    assert "env_server.host=10.0.0.3" in roles["env_server-1"].args and roles["env_server-1"].ready[0] == "10.0.0.3"
    assert "actor.env_servers=['10.0.0.2:25558']" in roles["actor-2"].args
    assert all("net.broker_host=10.0.0.0" in r.args and "weights.host=10.0.0.0" in r.args for r in roles.values())
    from launch.slurm import srun_argv
    assert srun_argv(learner, cfg.slurm)[:7] == ["srun", "--nodes=2", "--ntasks=4", "--nodelist=n0,n1",
                                                 "--kill-on-bad-exit=1", "--job-name=learner-0", "--ntasks-per-node=2"]
    for bad, match in [(("local.learner_ranks=2", "slurm.nodes=6"), "more than the run can use"),
                       (("local.learner_ranks=3", "slurm.nodes=4"), "do not split evenly")]:
        with pytest.raises(ValueError, match=match):
            allocation_roles(_run_cfg("local.actors=3", "slurm.learner_nodes=2", *bad),
                             [Node(f"n{i}", "a") for i in range(int(bad[-1].split("=")[1]))], [], False)


def test_learner_ranks_come_from_the_slurm_step():
    assert ranks_from_slurm({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}) == \
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
    with pytest.raises(RuntimeError, match="SLURM_LOCALID"):
        ranks_from_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})


def test_roles_reserving_more_cpus_than_the_job_holds_on_a_node_are_refused():
    cfg = _run_cfg("local.actors=2", "slurm.nodes=2", "slurm.actor.cpus=3")
    nodes = [Node("a", "a"), Node("b", "b")]
    roles = allocation_roles(cfg, nodes, [], False)
    check_cpus(roles, cfg.slurm, nodes, {"SLURM_JOB_CPUS_PER_NODE": "2,6"})  # both actors on b: 6 of 6
    with pytest.raises(RuntimeError, match="reserve 6 CPUs .* holds 4 there"):
        check_cpus(roles, cfg.slurm, nodes, {"SLURM_JOB_CPUS_PER_NODE": "4(x2)"})


@pytest.mark.parametrize("args, match", [
    (["slurm.nodes=5", "local.actors=2"], "more than the run can use"),
    (["local.learner_ranks=3", "slurm.nodes=3", "slurm.learner_nodes=2"], "do not split evenly"),
    (["env_server.backend=apptainer", "env_server.desktop.image=/nonexistent/desktop.sif",
      "broker.tasks.suite=desk:train"], "is not a file"),
    (["env_server.backend=xvfb"], "names 'sim' tasks, and env_server.backend 'xvfb' runs 'desk' tasks"),
    (["slurm.nodes=0"], "must be >= 1"),
])
def test_bad_submissions_are_refused_before_anything_is_written(tmp_path, args, match):
    r = CliRunner().invoke(main, ["slurm", "submit", "configs/local.yaml", *args, "--run-dir", str(tmp_path / "r")])
    assert r.exit_code != 0 and match in r.output, r.output
    assert not (tmp_path / "r").exists()


PARTITIONS_SHOWN = (  # `scontrol show partition -o` of the test cluster, abridged
    "PartitionName=test AllowGroups=ALL Default=YES GraceTime={grace} MaxNodes=UNLIMITED PriorityTier=1 "
    "OverSubscribe=YES:4 PreemptMode={mode} State=UP TotalCPUs=2\n"
    "PartitionName=urgent AllowGroups=ALL Default=NO GraceTime=0 PriorityTier=10 PreemptMode=OFF State=UP\n")


@pytest.mark.parametrize("partition,mode,grace,warned", [
    ("", "REQUEUE", 120, True), ("test", "CANCEL", 60, True), ("", "REQUEUE", 300, False), ("", "OFF", 0, False),
    ("urgent", "REQUEUE", 120, False)])
def test_a_partition_that_preempts_with_a_short_grace_time_is_warned_of(tmp_path, monkeypatch, partition, mode, grace,
                                                                         warned):
    """The grace time of the job's partition (its default one when slurm.partition is empty) against the time the
    learner is given to stop: shorter, and a preempted learner can be killed before it checkpoints."""
    from launch.slurm import preemption_warning

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shown = PARTITIONS_SHOWN.format(grace=grace, mode=mode)
    (bin_dir / "scontrol").write_text(  # `scontrol show partition -o [NAME]`
        f"#!/bin/bash\n[ -n \"$4\" ] && {{ grep \"PartitionName=$4 \" <<'EOF'\n{shown}EOF\nexit; }}\n"
        f"cat <<'EOF'\n{shown}EOF\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    said = preemption_warning(_run_cfg(f"slurm.partition={partition}", "learner.checkpoint_every=10"))
    assert bool(said) == warned, said
    if warned:
        assert f"partition test preempts jobs (PreemptMode={mode}) with a grace time of {grace} s, less than " \
               "local.learner_stop_timeout_s 240 s" in said and "every 10 steps" in said, said
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert preemption_warning(_run_cfg()) == "", "no scontrol here: nothing to say"


def test_submitting_without_sbatch_says_so_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm tools here
    r = CliRunner().invoke(main, ["slurm", "submit", "configs/local.yaml", "--run-dir", str(tmp_path / "r")])
    assert r.exit_code != 0 and "sbatch not found on PATH" in r.output, r.output
    assert not (tmp_path / "r").exists()


def test_sbatchs_own_refusal_is_passed_on_with_context(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: nope' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    r = CliRunner().invoke(main, ["slurm", "submit", "configs/local.yaml", "slurm.partition=nope",
                                  "--run-dir", str(tmp_path / "r")])
    assert r.exit_code != 0, r.output
    assert "sbatch refused the job (partition nope, 1 node(s)): sbatch: error: invalid partition specified" in r.output


def test_a_resume_may_change_the_run_and_its_script_but_not_its_model(tmp_path, monkeypatch):
    """`slurm resume` took no overrides, so a run that had finished its steps ("raise learner.total_steps to train
    on") could go on only by editing files by hand."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in (("sbatch", "echo 4242"), ("squeue", "exit 0"), ("scontrol", "exit 1")):
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "r"
    r = CliRunner().invoke(main, ["slurm", "submit", "configs/local.yaml", "learner.total_steps=3",
                                  "--run-dir", str(run_dir)])
    assert r.exit_code == 0 and "submitted job 4242" in r.output, r.output
    script = run_dir / "slurm" / "job.sbatch"
    assert f"launch.cli run {run_dir / 'config.requested.yaml'} --run-dir {run_dir} --srun" in script.read_text()
    (run_dir / "checkpoints" / "step-00000003").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step-00000003")

    r = CliRunner().invoke(main, ["slurm", "resume", str(run_dir), "model.tokenizer=hf"])
    assert r.exit_code == 2 and "model.tokenizer: the run has 'auto', this resume gives 'hf'" in r.output, r.output
    assert "--time=04:00:00" in script.read_text()
    r = CliRunner().invoke(main, ["slurm", "resume", str(run_dir), "learner.total_steps=8", "slurm.time=02:00:00"])
    assert r.exit_code == 0 and "this resume changes learner.total_steps: 3 -> 8" in r.output \
        and "submitted job 4242" in r.output, r.output
    assert "--time=02:00:00" in script.read_text()
    assert load_run_config(run_dir / "config.requested.yaml").learner.total_steps == 8


def test_a_job_id_file_that_holds_no_job_id_is_refused_before_slurm_is_asked(tmp_path):
    """An edited or damaged ``slurm/job_id`` went to squeue and scancel as it was (one starting with "-" as an
    option) and status showed it as the job."""
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "job_id").write_text("-u root\n")
    for command in ("status", "cancel"):
        r = CliRunner().invoke(main, ["slurm", command, str(tmp_path)])
        assert r.exit_code == 1 and "holds '-u root', not a Slurm job id" in r.output, r.output


def test_one_job_per_run_directory_a_second_submission_is_refused(tmp_path, monkeypatch):
    """A queued job holds no claim on its run directory yet, and `slurm submit` did not look for checkpoints: a
    second submission queued a second job of the run, and one into a run that had checkpointed replaced its config
    (model included) and resumed from its checkpoint under it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "squeue-says"
    state.write_text("PENDING|0:00|4:00:00|(Priority)\n")
    for tool, body in (("sbatch", "echo 4242"), ("squeue", f"cat {state}"), ("scontrol", "exit 1")):
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "r"
    submit = ["slurm", "submit", "configs/local.yaml", "--run-dir", str(run_dir)]
    r = CliRunner().invoke(main, [*submit, "learner.total_steps=3"])
    assert r.exit_code == 0 and "submitted job 4242" in r.output, r.output
    requested = (run_dir / "config.requested.yaml").read_text()
    for args in ([*submit, "learner.total_steps=5"], ["slurm", "resume", str(run_dir)]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and "job 4242 of this run is still pending: one job per run directory" in r.output, \
            r.output
    assert (run_dir / "config.requested.yaml").read_text() == requested

    state.write_text("")  # the job left the queue, having checkpointed
    whole_checkpoint(run_dir / "checkpoints", 3)
    for args in ([*submit, "learner.total_steps=8"], [*submit, "--dry-run"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and f"continue it with computerrl slurm resume {run_dir}" in r.output, r.output
    assert (run_dir / "config.requested.yaml").read_text() == requested
    r = CliRunner().invoke(main, ["slurm", "resume", str(run_dir)])
    assert r.exit_code == 0 and "submitted job 4242" in r.output, r.output


def _fake_tools(bin_dir: Path, log: Path) -> Path:
    """A stand-in for `computerrl run` (exits 75 on SIGTERM, as the supervisor does) and a recording scontrol."""
    bin_dir.mkdir()
    run = bin_dir / "fake-python"
    # The trap comes first and the sleep holds no pipe: a notice at any moment ends it cleanly.
    run.write_text(f"#!/bin/bash\ntrap 'kill $pid 2>/dev/null; echo stopped >> {log}; exit {EXIT_RESUMABLE}' TERM\n"
                   f"sleep 30 >/dev/null 2>&1 & pid=$!\necho \"run $*\" >> {log}\nwait $pid\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho \"scontrol $*\" >> {log}\n")
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return run


def _job(script: Path, bin_dir: Path, log: Path, notice: int | None = 12) -> tuple[int, str]:
    """Run the batch script as Slurm would; once the run started, send the batch shell ``notice``."""
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    starts = sum(line.startswith("run ") for line in log.read_text().splitlines()) if log.exists() else 0
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 10
    while not (log.exists() and sum(line.startswith("run ") for line in log.read_text().splitlines()) > starts):
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.05)
    job.send_signal(notice)
    out, _ = job.communicate(timeout=20)
    return job.returncode, out


@pytest.mark.parametrize("requeue", [True, False])
def test_a_preemption_notice_stops_the_run_resumably_and_requeues_the_job(tmp_path, requeue):
    log = tmp_path / "calls.log"
    python = _fake_tools(tmp_path / "bin", log)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "slurm").mkdir()
    cfg = _run_cfg(f"slurm.python={python}", f"slurm.requeue={requeue}", "slurm.max_requeues=2")
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(cfg, run_dir, run_dir / "config.yaml"))
    rc, out = _job(script, tmp_path / "bin", log, notice=12)  # SIGUSR2: Slurm's notice before the time limit
    calls = log.read_text().splitlines()
    assert rc == EXIT_RESUMABLE, out
    assert calls[0].startswith(f"run -m launch.cli run {run_dir / 'config.yaml'} --run-dir {run_dir} --srun")
    assert "--resume" not in calls[0], "no checkpoint yet: a fresh start"
    assert calls[1] == "stopped", "the run got the notice (it checkpoints and stops)"
    assert (calls[2:] == ["scontrol requeue 4242"]) == requeue, calls
    after = "requeued" if requeue else "not_requeued"
    assert attempts_ended(run_dir) == [{"job": "4242", "attempt": 1, "exit_code": EXIT_RESUMABLE, "ended": "notice",
                                        "after": after}]
    # The next attempts, with a checkpoint on disk, resume; a preemption's SIGTERM is a notice too.
    (run_dir / "checkpoints" / "latest").write_text("step-00000002")
    for _ in range(2):
        rc, out = _job(script, tmp_path / "bin", log, notice=15)
    calls = log.read_text().splitlines()
    assert all("--resume" in c for c in [c for c in calls if c.startswith("run ")][1:])
    if requeue:
        assert sum(c == "scontrol requeue 4242" for c in calls) == 2, "slurm.max_requeues caps the requeues"
        assert (run_dir / "slurm" / "requeues").read_text().strip() == "2"
        assert "not requeued: 2 requeues already" in out
        assert [a["after"] for a in attempts_ended(run_dir)] == ["requeued", "requeued", "not_requeued"]
    else:
        assert not any(c.startswith("scontrol") for c in calls)


def test_a_run_stopped_through_its_job_steps_is_requeued_though_the_batch_shell_got_no_notice(tmp_path):
    """A preemption TERMs the job steps, not the batch shell: the supervisor stops by itself and exits 75, which is
    requeued as a notice is. Where ``scontrol requeue`` fails (Slurm requeued or cancelled the job itself), the
    script says how to resume."""
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    run = bin_dir / "fake-python"
    run.write_text(f"#!/bin/bash\necho \"run $*\" >> {log}\nexit {EXIT_RESUMABLE}\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho \"scontrol $*\" >> {log}\n"
                                      "echo 'scontrol: error: Job is pending execution' >&2; exit 1\n")
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(_run_cfg(f"slurm.python={run}"), run_dir, run_dir / "config.yaml"))
    out = subprocess.run(["bash", str(script)], env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                                                    "SLURM_JOB_ID": "4242"}, capture_output=True, text=True, timeout=20)
    assert out.returncode == EXIT_RESUMABLE, out
    assert log.read_text().splitlines()[1:] == ["scontrol requeue 4242"]
    assert (run_dir / "slurm" / "requeues").read_text().strip() == "1"
    assert f"scontrol requeue failed (above): if the job has left the queue, continue with: computerrl slurm resume " \
           f"{run_dir}" in out.stdout, out.stdout
    assert [(a["ended"], a["after"]) for a in attempts_ended(run_dir)] == [("preempted", "requeue_refused")]


def test_a_cancelled_run_stops_cleanly_and_is_not_requeued(tmp_path):
    log = tmp_path / "calls.log"
    python = _fake_tools(tmp_path / "bin", log)
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(_run_cfg(f"slurm.python={python}"), run_dir, run_dir / "config.yaml"))
    job_files(run_dir)["cancelled"].write_text("1\n")  # what `computerrl slurm cancel` leaves before signalling
    rc, out = _job(script, tmp_path / "bin", log, notice=15)
    assert rc == 0 and "cancelled (computerrl slurm cancel)" in out, out
    assert log.read_text().splitlines()[1:] == ["stopped"], "the run stopped; nothing requeued"
    assert [(a["exit_code"], a["ended"], a["after"]) for a in attempts_ended(run_dir)] == [
        (EXIT_RESUMABLE, "cancelled", "-")]


def test_attempts_are_read_back_and_a_torn_line_is_skipped(tmp_path):
    (tmp_path / "slurm").mkdir()
    job_files(tmp_path)["attempts"].write_text("17 1 75 preempted requeued\n17 2 1 failed -\n17 3 0 fini")
    assert attempts_ended(tmp_path) == [
        {"job": "17", "attempt": 1, "exit_code": 75, "ended": "preempted", "after": "requeued"},
        {"job": "17", "attempt": 2, "exit_code": 1, "ended": "failed", "after": "-"}]
    assert attempts_ended(tmp_path / "none") == []


def _submit(cluster, run_dir: Path, *overrides: str) -> str:
    """Submit a small run spread over the test cluster's three nodes (CURVE on, as across real nodes)."""
    args = [f"net.broker_front_port={free_port()}", f"net.broker_back_port={free_port()}",
            f"net.broker_control_port={free_port()}", f"env_server.port={free_port()}", f"weights.port={free_port()}",
            f"local.learner_dist_port={free_port()}", "net.curve=on", "slurm.nodes=3", "local.actors=2",
            "weights.join_window_s=0.5", "local.eval_episodes=0", "learner.checkpoint_every=1",
            "slurm.signal_grace_s=60", "slurm.time=00:30:00",
            # Slurm is the point, not the recipe: no anchor, groups of 4 (half the rollouts per step)
            "learner.anchor.suite=", "broker.group_size=4", *overrides]
    out = _cli(cluster, "slurm", "submit", "configs/local.yaml", *args, "--run-dir", str(run_dir))
    return out.split("submitted job ")[1].split(";")[0]


def _cli(cluster, *argv: str, check: bool = True) -> str:
    out = subprocess.run([sys.executable, "-m", "launch.cli", *argv], cwd=REPO, capture_output=True, text=True,
                         env={**cluster.env, "PYTHONPATH": str(REPO)}, timeout=900)
    assert out.returncode == 0 or not check, out.stdout + out.stderr
    return out.stdout


def _learner_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / "learner.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _wait(cluster, what, deadline: float, message: str) -> None:
    while not what():
        assert time.monotonic() < deadline, f"{message}:\n{cluster.log_tail()}"
        time.sleep(1)


def _audited(cluster, run_dir: Path) -> dict:
    result = json.loads(_cli(cluster, "audit", str(run_dir), "--json"))
    assert result["lost"] == 0 and result["trained_twice"] == 0, result
    return result


@pytest.mark.slow
def test_a_run_over_three_nodes_preempted_by_an_urgent_job_gives_its_nodes_back_resumes_and_loses_nothing(
        slurm_cluster, tmp_path):
    """A job of the higher-priority partition takes the run's three nodes: Slurm TERMs every job step at once, not the
    batch shell. The run keeps the steps it trained, gives its nodes back well inside its grace time rather than
    holding them to the end of it (restarting its stopped roles, as it once did), and finishes in its next attempt.
    (A notice to the batch shell, what a time limit gives, is the cancel test's path on this cluster, and the stand-in
    tests' with USR2.)"""
    from tests.slurm_cluster import PREEMPTION_GRACE_S

    run_dir = tmp_path / "run"
    t_submit = time.monotonic()
    # The recipe's own checkpoint period (10 steps, more than the run): progress survives only if the preemption
    # makes the learner checkpoint before it exits.
    every = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())["learner"]["checkpoint_every"]
    assert every > 6
    job = _submit(slurm_cluster, run_dir, "learner.total_steps=6", f"learner.checkpoint_every={every}")
    urgent_ran, urgent = tmp_path / "urgent-ran", ""
    deadline = t_submit + 900
    try:
        _wait(slurm_cluster, lambda: _learner_steps(run_dir), deadline, "the job never trained")
        t_first_step = time.monotonic()
        _wait(slurm_cluster, lambda: len(_learner_steps(run_dir)) >= 2, deadline, "no second step")
        step_at_preemption = _learner_steps(run_dir)[-1]["step"]
        # Every node, whole: Slurm must take them from the run. The urgent job says when it ran and how far the run
        # had got by then.
        urgent = slurm_cluster.run(
            "sbatch", "--parsable", "--partition=urgent", "--nodes=3", "--exclusive", f"--output={tmp_path}/urgent.out",
            "--wrap", f"echo $(date +%s) $(wc -l < {run_dir}/metrics/learner.jsonl) > {urgent_ran}")
        t_urgent = time.time()
        _wait(slurm_cluster, urgent_ran.exists, deadline, "the urgent job never ran")
        t_resumed = time.monotonic()
        _wait(slurm_cluster, lambda: not slurm_cluster.job_state(job), deadline, "the job did not finish")
    finally:
        for j in (job, urgent):
            if j:
                slurm_cluster.run("scancel", j, check=False)
    ran_at, steps_then = (int(x) for x in urgent_ran.read_text().split())
    print(f"\nslurm timings: submit -> first learner step {t_first_step - t_submit:.0f} s; urgent job submitted -> "
          f"running {ran_at - t_urgent:.0f} s (grace {PREEMPTION_GRACE_S} s); the run resumed and finished "
          f"{time.monotonic() - t_resumed:.0f} s after")
    assert steps_then < 6, "the urgent job ran before the run was over: it took the nodes from it"
    assert ran_at - t_urgent < PREEMPTION_GRACE_S / 2, "the preempted run gave its nodes back well inside its grace"
    job_log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    for said in ("attempt 1", "learner-0 stopped on a signal the supervisor did not send",
                 f"requeueing job {job} to resume the run (requeue 1)", "attempt 2", "outcome: finished"):
        assert said in job_log, (said, job_log[-4000:])
    assert "restart" not in job_log.split("attempt 2")[0], "no role restarted at the preemption"
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000006"
    assert (run_dir / "slurm" / "requeues").read_text().strip() == "1"
    # Each role ran on its node (a stderr file per role, node, job and attempt), at that node's address.
    logs = {p.name for p in (run_dir / "logs").glob("*.stderr")}
    for attempt in (1, 2):
        for label, node in (("broker-0", "cn1"), ("learner-0", "cn1"), ("env_server-0", "cn2"), ("actor-0", "cn2"),
                            ("env_server-1", "cn3"), ("actor-1", "cn3")):
            assert f"{label}@{node}.job{job}.attempt{attempt}.stderr" in logs, sorted(logs)
    assert "host: 127.0.0.3" in (run_dir / "config.env_server-1.yaml").read_text()
    assert "127.0.0.3:" in (run_dir / "config.actor-1.yaml").read_text()
    broker_log = [json.loads(x) for x in (run_dir / "logs" / "broker-0.jsonl").read_text().splitlines()]
    ready = [r for r in broker_log if r["event"] == "broker_ready"]
    assert len(ready) == 2 and all(r["curve"] for r in ready), ready
    # The preemption's TERM reached the broker and the env_servers too: they served on until the supervisor
    # stopped them, after the learner.
    assert any(r["event"] == "broker_term_deferred" for r in broker_log)
    for rank in (0, 1):
        assert '"env_server_term_deferred"' in (run_dir / "logs" / f"env_server-{rank}.jsonl").read_text()
    result = _audited(slurm_cluster, run_dir)
    assert result["learner_starts"] == 2, "the second attempt resumed the learner from its checkpoint"
    # Nothing trained before the preemption is trained again: its checkpoint covers every settlement.
    assert result["rolled_back_settlements"] == 0, result
    learner_log = [json.loads(x) for x in (run_dir / "logs" / "learner-0.jsonl").read_text().splitlines()]
    resumed = [e["version"] for e in learner_log if e["event"] == "resumed"]
    assert resumed and resumed[0] >= step_at_preemption, (resumed, step_at_preemption)
    assert [(a["attempt"], a["ended"], a["after"]) for a in attempts_ended(run_dir)] == [
        (1, "preempted", "requeued"), (2, "finished", "-")]


@pytest.mark.slow
def test_status_and_cancel_on_a_live_job_then_resume(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    # Two heterogeneous components: broker and learner on cn1, the env_servers and actors on cn2 and cn3.
    every = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())["learner"]["checkpoint_every"]
    job = _submit(slurm_cluster, run_dir, "learner.total_steps=3", "slurm.rollout.separate=true",
                  f"learner.checkpoint_every={every}")  # the recipe's: only the cancel's checkpoint saves the steps
    deadline = time.monotonic() + 900
    try:
        _wait(slurm_cluster, lambda: _learner_steps(run_dir), deadline, "the job never trained")
        status = json.loads(_cli(slurm_cluster, "slurm", "status", str(run_dir), "--json"))
        assert status["job"] == job and status["state"] == "RUNNING" and status["attempt"] == 1, status
        assert status["learner"]["step"] >= 1, status
        assert {"broker", "learner", "env_server-0", "env_server-1", "actor-0", "actor-1"} <= set(status["metrics"])
        assert any(p.name.startswith("actor-1@cn3.") for p in (run_dir / "logs").glob("*.stderr"))
        assert "stopped (the learner checkpointed" in _cli(slurm_cluster, "slurm", "cancel", str(run_dir))
        assert not slurm_cluster.job_state(job), "a cancelled job is not requeued"
        status = json.loads(_cli(slurm_cluster, "slurm", "status", str(run_dir), "--json"))
        assert status["state"] == "COMPLETED" and status["cancelled"], status
        assert [(x["ended"], x["after"]) for x in status["attempts"]] == [("cancelled", "-")], status
        assert status["checkpoint"].startswith("step-"), status
        job_log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
        assert "cancelled (computerrl slurm cancel)" in job_log and "requeueing" not in job_log, job_log[-2000:]
        # One step more than the run was asked for: a resume after the cancel's checkpoint always has one to train.
        said = _cli(slurm_cluster, "slurm", "resume", str(run_dir), "learner.total_steps=4")
        assert "this resume changes learner.total_steps: 3 -> 4" in said, said
        resumed = said.split("submitted job ")[1].split(";")[0]
        assert resumed != job
        _wait(slurm_cluster, lambda: not slurm_cluster.job_state(resumed), deadline,
              "the resumed job did not finish")
    finally:
        slurm_cluster.run("scancel", job, check=False)
    resumed_log = (run_dir / "logs" / f"slurm-{resumed}.out").read_text()
    assert "outcome: finished" in resumed_log
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000004"
    audit = _audited(slurm_cluster, run_dir)
    assert audit["learner_starts"] == 2 and audit["rolled_back_settlements"] == 0, audit


@pytest.mark.slow
def test_two_learner_ranks_on_two_nodes_train_as_one_learner(slurm_cluster, tmp_path):
    """One learner step of two tasks over cn1 and cn2 (RANK from SLURM_PROCID, MASTER_ADDR the first node, gloo),
    the actor on cn3: the run trains with both ranks and finishes. After its first step rank 0 is stopped for good:
    its pulse stops, and the supervisor has the step killed on both nodes (not only its srun, which left a hung task
    holding its ports for the cluster's KillWait while its successor failed to bind them) and restarts it."""
    from launch.chaos import role_pids

    run_dir = tmp_path / "run"
    job = _submit(slurm_cluster, run_dir, "learner.total_steps=3", "local.learner_ranks=2", "slurm.learner_nodes=2",
                  "local.actors=1", "learner.advantage.drop_zero_variance=false", "local.hang_timeout_s=8")
    deadline = time.monotonic() + 900
    try:
        _wait(slurm_cluster, lambda: _learner_steps(run_dir), deadline, "the job never trained")
        # The nodes are this machine: rank 0's task is a process here (its rank is Slurm's, in its environment).
        rank0 = [p for p in role_pids(run_dir, "learner")
                 if b"SLURM_PROCID=0" in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")]
        assert len(rank0) == 1, rank0
        os.kill(rank0[0], signal.SIGSTOP)
        _wait(slurm_cluster, lambda: not slurm_cluster.job_state(job), deadline, "the job did not finish")
    finally:
        slurm_cluster.run("scancel", job, check=False)
    job_log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert "outcome: finished" in job_log, job_log[-3000:]
    assert re.search(r"learner-0 killed: hung: its main loop gave no sign of life for \d+ s \(local.hang_timeout_s\); "
                     rf".*; step {job}\.\d+ killed \(scancel --signal=KILL\)", job_log), job_log[-3000:]
    assert "learner-0 exited with code 137; restart 1" in job_log and "restart 2" not in job_log, job_log[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000003"
    audit = _audited(slurm_cluster, run_dir)
    assert audit["learner_starts"] == 2, audit
    logs = {p.name for p in (run_dir / "logs").glob("*.stderr")}
    assert f"learner-0@cn1+cn2.job{job}.attempt1.stderr" in logs and f"actor-0@cn3.job{job}.attempt1.stderr" in logs
    assert (run_dir / "logs" / "learner-0.jsonl").read_text().count('"train_step"') >= 2
    # Rank 1 (on cn2) joined rank 0's process group — or rank 0 could not have started — followed every step,
    # and left when rank 0 said stop.
    assert '"learner_rank_stopping"' in (run_dir / "logs" / "learner-1.jsonl").read_text()
