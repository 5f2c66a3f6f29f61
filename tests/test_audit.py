"""The audit's reading of a learner's trail (``common/audit.py``): one lineage of versions per run directory."""

from __future__ import annotations

from common.audit import reconcile_events


def _acked(*groups: str) -> list[dict]:
    return [{"e": "acked", "g": g} for g in groups]


def test_two_learners_writing_one_trail_fail_the_audit_that_one_learner_resuming_passes():
    """As the trail read on 2026-12-03 when a second `run --resume` of a running run started a learner beside the
    first (``common/claims.py`` now refuses it where the file system locks): the second resumed from checkpoint 10
    and both went on from there. Every group was trained once and the audit said so; it took the two for one
    learner that had resumed."""
    groups = [f"g{i}" for i in range(16)]
    first = [{"e": "resume", "v": 0}] + [{"e": "trained", "gs": [groups[v - 1]], "v": v} for v in range(1, 11)]
    first.append({"e": "checkpoint", "v": 10})
    resumed = [{"e": "resume", "v": 10}, {"e": "trained", "gs": [groups[10]], "v": 11},
               {"e": "trained", "gs": [groups[11]], "v": 12}, {"e": "checkpoint", "v": 12}]
    one = reconcile_events(_acked(*groups[:12]), first + resumed, set())
    assert one.ok and one.out_of_order == 0 and one.trained_once == 12, one.table()

    # Interleaved: the first learner's steps 11, 12, 13 between the second's 11 and 12.
    both = first + [{"e": "resume", "v": 10}, {"e": "trained", "gs": [groups[10]], "v": 11},
                    {"e": "trained", "gs": [groups[12]], "v": 11}, {"e": "trained", "gs": [groups[13]], "v": 12},
                    {"e": "trained", "gs": [groups[11]], "v": 12}, {"e": "trained", "gs": [groups[14]], "v": 13},
                    {"e": "checkpoint", "v": 13}, {"e": "checkpoint", "v": 12}]
    two = reconcile_events(_acked(*groups[:15]), both, set())
    assert not two.lost and not two.trained_twice, two.table()
    assert two.out_of_order == 2 and not two.ok
    assert "LEARNER STEPS OUT OF ORDER (two learners at once)        2" in two.table()
    assert two.as_dict()["learner_steps_out_of_order"] == 2


def test_a_directory_that_is_no_run_is_refused_not_audited_as_a_run_of_nothing(tmp_path):
    """Found by hand (2026-12-03): `computerrl audit /tmp` printed a table of zeros, "LOST 0", and exited 0, so a
    mistyped run directory passed the audit; `computerrl top` drew an empty run for it."""
    from click.testing import CliRunner

    from common.audit import AuditLog
    from launch.cli import main

    for command in (["audit", str(tmp_path)], ["top", str(tmp_path), "--once"]):
        out = CliRunner().invoke(main, command)
        assert out.exit_code == 2 and "not a run directory (no config.yaml, metrics/ or audit/)" in out.output, \
            (command, out.output)
    trail = AuditLog(tmp_path / "audit" / "broker.jsonl")  # roles started by hand leave a trail, maybe no config.yaml
    trail.write("acked", gs=["g1"])
    trail.close()
    out = CliRunner().invoke(main, ["audit", str(tmp_path)])
    assert out.exit_code == 1 and "acked groups" in out.output, "audited: an acked group never trained is lost"
