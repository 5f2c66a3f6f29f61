#!/usr/bin/env bash
# Replay on a lent GPU machine (docs/recipe.md, "Replay of successes"): broker.replay off against family
# (replay_max_age 40), 2 seeds each, all four runs of configs/broad.yaml at once from a clone (default: the
# 2.43 M one, built as docs/recipe.md says), learners and actors on the GPU, for DUR seconds of training. Then each
# run's checkpoint at the highest step all four reached is evaluated greedily on the held-out split, and each run
# is audited (exactly-once). A wall-time budget, not a step count, because a lent machine's minutes are counted:
# the runs are compared at the same step.
#   OUT=dir bash launch/gpu-replay.sh DUR DEVICE ACTORS EPISODES     (M="model.path=... ..." picks the policy)
set -uo pipefail
DUR=${1:-300}; DEV=${2:-cuda}; ACTORS=${3:-3}; EPIS=${4:-40}
if ls build/wheels/*.whl >/dev/null 2>&1 && ! python3 -c "import zmq, structlog" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
set -f
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PYTHON:-python3}
(nvidia-smi -L 2>/dev/null; nproc --all) > "$OUT/machine.txt"
R=/tmp/replay-runs; rm -rf "$R"; mkdir -p "$R"
M=${M-"model.path=build/clone-256 model.hidden_size=256 model.intermediate_size=512"}
C="learner.device=$DEV actor.engine.device=$DEV local.actors=$ACTORS local.torch_threads=1 learner.total_steps=1000
   learner.checkpoint_every=10 learner.keep_checkpoints=1000 local.eval_episodes=0 broker.replay_max_age=40"
$PY - > "$R/ports.txt" <<'PYEOF'
from launch.local import free_port_overrides
taken = set()
for _ in range(4):
    print(" ".join(free_port_overrides(taken)))
PYEOF
i=0; t0=$(date +%s)
for arm in off family; do for seed in 0 1; do
  i=$((i+1)); ports=$(sed -n ${i}p "$R/ports.txt")
  $PY -m launch.cli run configs/broad.yaml --run-dir "$R/$arm-$seed" $M $C run.seed=$seed broker.replay=$arm $ports \
    > "$R/$arm-$seed.log" 2>&1 &
done; done
sleep "$DUR"
pkill -INT -f "launch.cli run configs/broad.yaml"
wait
echo "training wall $(( $(date +%s) - t0 )) s"
# The highest checkpoint step every run reached.
S=$($PY - "$R" <<'PYEOF'
import sys, pathlib
runs = [p for p in pathlib.Path(sys.argv[1]).iterdir() if p.is_dir()]
steps = [{int(c.name.split("-")[1]) for c in (r / "checkpoints").glob("step-*")} for r in runs]
common = set.intersection(*steps) if steps else set()
print(max(common) if common else 0)
PYEOF
)
echo "evaluating step $S"
FAMS="sheet_sort,sheet_sum,editor_append,files_rename_latest,editor_replace sheet_to_editor,editor_to_sheet,files_create_folder,settings_display,files_delete files_move,files_rename,settings_profile,infeasible,sheet_set_cell"
t1=$(date +%s)
for run in off-0 off-1 family-0 family-1; do
  ck=$(printf "%s/%s/checkpoints/step-%08d" "$R" "$run" "$S"); k=0
  [ "$S" -gt 0 ] || ck="$R/$run/checkpoints"  # no step all reached: each run's latest
  for fams in $FAMS; do k=$((k+1))
    $PY -m launch.cli eval --checkpoint "$ck" --suite "sim:heldout:$fams" --episodes "$EPIS" -c configs/broad.yaml --json \
      > "$R/eval-$run-$k.json" 2> "$R/eval-$run-$k.err" &
  done
done
wait
echo "eval wall $(( $(date +%s) - t1 )) s"
for run in off-0 off-1 family-0 family-1; do $PY -m launch.cli audit "$R/$run" > "$R/audit-$run.txt" 2>&1; done
$PY - "$R" "$S" "$OUT" <<'PYEOF'
import json, sys, pathlib
R, S, OUT = pathlib.Path(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
out = {"step": S, "runs": {}}
for run in ("off-0", "off-1", "family-0", "family-1"):
    evals = []
    for f in sorted(R.glob(f"eval-{run}-*.json")):
        try:
            evals.append(json.loads(f.read_text()))
        except ValueError:
            evals.append({"error": (R / f.name.replace(".json", ".err")).read_text()[-500:]})
    def lines(p):
        return [json.loads(l) for l in p.read_text().splitlines() if l.strip().startswith("{")] if p.exists() else []
    learner = lines(R / run / "metrics" / "learner.jsonl")
    broker = lines(R / run / "metrics" / "broker.jsonl")
    keep = ("version", "step", "phase", "success_rate", "entropy", "replayed", "max_lag", "groups", "is_weight_mean",
            "clip_frac", "time", "step_s", "tokens_per_s", "loss")
    out["runs"][run] = {"eval": evals, "audit": (R / f"audit-{run}.txt").read_text(),
                        "learner": [{k: m[k] for k in keep if k in m} for m in learner],
                        "broker_last": broker[-1] if broker else None}
(OUT / "replay-summary.json").write_text(json.dumps(out))
PYEOF
tar czf "$OUT/replay-logs.tgz" -C "$R" --exclude=checkpoints --exclude=spill --exclude=demos . 2>/dev/null
ls -la "$OUT"
